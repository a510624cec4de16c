"""ChatLearn's `lora:` keys (its LoraConfig: enable_lora, lora_dim, lora_scaling, lora_dropout,
lora_layer, column_only_qkv, part_module_name) read as chatgen's `lora:` of a trainer model
(chatgen/training/config.py), in the chatlearn config dialect (chatgen/compat/chatlearn.py calls
`read_lora`).

    lora:                                   # ChatLearn                  ->  chatgen
      enable_lora: true                     # false: no LoRA             ->  (no lora section: rank 0)
      lora_dim: 8                           # rank                       ->  rank: 8
      lora_scaling: 2.0                     # W + A B * lora_scaling     ->  alpha: 16 (alpha / rank = 2.0)
      lora_dropout: 0.05                    #                            ->  dropout: 0.05
      lora_layer: ColumnParallelLinear,RowParallelLinear   # classes    ->  target_modules: q/k/v/gate/up, o/down
      column_only_qkv: true                 # the QKV projection only    ->  target_modules: [q_proj, k_proj, v_proj]

What has no chatgen meaning is refused by name: `part_module_name` (chatgen names targets,
`lora.target_modules`), an embedding class in `lora_layer` (chatgen adapts linear layers only), a
key ChatLearn does not have.
"""

from chatgen.config.loader import at

KEYS = (
    "enable_lora",
    "part_module_name",
    "lora_dim",
    "lora_dropout",
    "lora_scaling",
    "lora_layer",
    "column_only_qkv",
)
# ChatLearn's LoRA layer classes -> the HF targets they hold in a Megatron decoder layer
COLUMN = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
ROW = ["o_proj", "down_proj"]
LAYERS = {"ColumnParallelLinear": COLUMN, "RowParallelLinear": ROW, "LinearLayer": []}
EMBEDDINGS = ("Embedding", "VocabParallelEmbedding")
DEFAULT_LAYERS = (
    "ColumnParallelLinear,Embedding,LinearLayer,RowParallelLinear,VocabParallelEmbedding"
)
QKV = ["q_proj", "k_proj", "v_proj"]


def is_chatlearn(value) -> bool:
    """Whether a `lora:` value is spelled ChatLearn's way (any of its keys)."""
    return isinstance(value, dict) and any(k in value for k in KEYS)


def read_lora(value: dict, where: dict, errors: list) -> dict | None:
    """chatgen's `lora:` for ChatLearn's (None: LoRA off, or an error appended to `errors`)."""
    problems = [
        f"{at(where, ('lora', k))}: not a key of ChatLearn's lora section (its keys: {', '.join(KEYS)}); "
        "write the section with chatgen's keys (rank, alpha, dropout, target_modules; docs/lora.md) or "
        "ChatLearn's only"
        for k in value
        if k not in KEYS
    ]
    if value.get("part_module_name"):
        problems.append(
            f"{at(where, ('lora', 'part_module_name'))}: {value['part_module_name']!r} has no chatgen meaning "
            "(chatgen adapts the layers its targets name in every decoder layer); drop it and pick the "
            "layers with lora.target_modules (q_proj ... down_proj)"
        )
    given = value.get("lora_layer")
    names = [n.strip() for n in str(given or DEFAULT_LAYERS).split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYERS and n not in EMBEDDINGS]
    if unknown:
        problems.append(
            f"{at(where, ('lora', 'lora_layer'))}: {unknown} are not ChatLearn LoRA layer classes; use some "
            f"of {', '.join(LAYERS)}"
        )
    if given is not None and any(n in EMBEDDINGS for n in names):
        problems.append(
            f"{at(where, ('lora', 'lora_layer'))}: {[n for n in names if n in EMBEDDINGS]}: chatgen adapts "
            "linear layers only, not embeddings; drop them from lora_layer"
        )
    if problems:
        errors.extend(problems)
        return None
    if not value.get("enable_lora", False):
        return None
    targets = [t for n in names for t in LAYERS.get(n, [])]
    if value.get("column_only_qkv"):
        targets = [t for t in targets if t in QKV]
    rank = value.get("lora_dim", 8)  # ChatLearn's defaults
    out = {
        "rank": rank,
        "alpha": float(value.get("lora_scaling", 1.0)) * rank,
        "dropout": value.get("lora_dropout", 0.0),
        # in the family's order, once each
        "target_modules": [
            t for t in [*QKV, "o_proj", "gate_proj", "up_proj", "down_proj"] if t in targets
        ],
    }
    return out
