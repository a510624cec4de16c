"""`RolloutBatch`: the one data contract between generation and every algorithm.

    batch = policy.run_generation(items)          # VLLMModule.decode_internal returns a RolloutBatch
    batch.input_ids, batch.loss_mask, batch.infer_logprobs, batch.texts, batch.metadata
    data = batch.trainer_inputs().replace(old_logprobs=..., advantages=...)   # what a trainer step takes

S samples, sample j of prompt i at row i * n + j (prompt-major, in the order the prompts were
given); L = the longest prompt + response. Per-token tensors have L - 1 columns, aligned with a
trainer's per-token outputs (MegatronModule.forward_tokens): entry t belongs to token t + 1, the
token predicted from the prefix up to t. So `loss_mask[s, t] = 1` says "train on predicting token t
+ 1 of sample s", and `infer_logprobs[s, t]` is vLLM's log-prob of that token when it sampled it.

A mixture-of-experts policy whose engine records routing (VLLMConfig.return_routed_experts) also
fills `routed_experts` (S, L, layers, k): the experts the engine sent token t to in each MoE layer,
what a trainer with moe_routing_replay computes with.

Names used across chatgen for the log-probs of sampled tokens: `infer_logprobs` (the inference
engine's, when it sampled), `old_logprobs` (the trainer's, before this episode's update),
`ref_logprobs` (the frozen reference model's). Pure torch (and numpy): no vLLM, Megatron or Ray import.
"""

import dataclasses

import numpy
import torch

from chatgen.core.train_batch import TrainBatch


@dataclasses.dataclass
class Sample:
    """One prompt + response, the unit `RolloutBatch.from_samples` assembles (e.g. from a
    server's turns)."""

    prompt_ids: list  # list[int]
    response_ids: list  # list[int]
    response_logprobs: list  # list[float], one per response token (the engine's)
    prompt_index: int = 0
    text: str = ""
    prompt_text: str | None = None
    finish_reason: str = "stop"
    response_mask: list | None = (
        None  # 1/0 per response token (0 = not trained on, e.g. tool output); None = all 1
    )
    weight_versions: list | None = (
        None  # per response token: the engine's weight version when it was sampled
    )
    prompt_logprobs: list | None = (
        None  # per prompt token (the first one's is 0), when the engine computed them
    )
    routed_experts: object = (
        None  # (positions, layers, k) int array: each token's experts in each MoE layer, -1 = none
    )
    metadata: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RolloutBatch:
    """S generated samples; see the module docstring for the layout."""

    input_ids: torch.Tensor  # (S, L) long: prompt + response, right-padded with the pad token
    prompt_lengths: torch.Tensor  # (S,) long
    response_lengths: torch.Tensor  # (S,) long
    loss_mask: torch.Tensor  # (S, L-1) float: 1 where token t+1 is a response token the loss sees
    # (S, L-1) float: the engine's log-prob of token t+1 (response tokens; prompt tokens
    infer_logprobs: torch.Tensor
    # too when the engine computed them: VLLMConfig.prompt_logprobs), else 0
    prompt_index: torch.Tensor  # (S,) long: which prompt of the call each sample answers
    texts: list  # list[str]: response texts ("" for a model without a tokenizer)
    prompt_texts: list  # list[str | None]
    finish_reasons: list  # list[str]: "stop" (EOS / stop string), "length" (token limit) or "abort"
    metadata: list  # list[dict]: per-sample fields the caller attaches (e.g. the prompt record's "answer")
    weight_versions: torch.Tensor | None = (
        None  # (S, L-1) long: engine weight version per sampled token, -1 elsewhere
    )
    routed_experts: torch.Tensor | None = (
        None  # (S, L, layers, k) long: the experts the engine routed token t to
    )
    # (MoE, return_routed_experts); -1 where it routed none (the last
    # token, padding): a replaying trainer routes those itself
    # {term name: (S,) float}: each reward term's values, and {term name: weight}, when the reward
    # is a weighted sum of terms (chatgen.rlhf.rewards:Rewards; set by Run.score; GDPO reads them)
    reward_terms: dict | None = None
    reward_weights: dict | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def attention_mask(self) -> torch.Tensor:
        """(S, L) long: 1 on prompt and response tokens, 0 on padding."""
        positions = torch.arange(self.input_ids.shape[1])
        return (positions[None, :] < (self.prompt_lengths + self.response_lengths)[:, None]).long()

    def trainer_inputs(self) -> TrainBatch:
        """What every trainer call needs: input_ids (S, L), attention_mask (S, L), loss_mask (S,
        L-1); plus routed_experts (S, L, layers, k) when the engine recorded them. An algorithm
        adds its own fields with `.replace(old_logprobs=..., advantages=...)`."""
        return TrainBatch(
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            loss_mask=self.loss_mask,
            routed_experts=self.routed_experts,
        )

    def select(self, index) -> "RolloutBatch":
        """The samples at `index` (a list or 1-D tensor of rows), in that order."""
        index = torch.as_tensor(index, dtype=torch.long)
        rows = index.tolist()
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value):
                fields[f.name] = value[index]
            elif isinstance(value, list):
                fields[f.name] = [value[i] for i in rows]
            elif isinstance(value, dict):  # per-sample tensors by name, other values kept
                fields[f.name] = {
                    k: v[index] if torch.is_tensor(v) else v for k, v in value.items()
                }
            else:
                fields[f.name] = value
        return RolloutBatch(**fields)

    @classmethod
    def concat(cls, batches: list, pad_token_id: int) -> "RolloutBatch":
        """The samples of `batches`, one batch after the other, right-padded to the longest
        (input_ids with pad_token_id, weight versions with -1, the other per-token tensors with
        0). prompt_index is kept as it is: make it unique first when the batches answer different
        prompts."""
        width = max(b.input_ids.shape[1] for b in batches)
        pads = {"input_ids": pad_token_id, "weight_versions": -1}
        fields = {}
        for f in dataclasses.fields(cls):
            values = [getattr(b, f.name) for b in batches]
            if isinstance(values[0], list):
                fields[f.name] = [x for value in values for x in value]
            elif any(v is None for v in values):
                fields[f.name] = None  # weight versions that not every batch has
            elif isinstance(values[0], dict):
                fields[f.name] = {
                    k: torch.cat([v[k] for v in values]) if torch.is_tensor(x) else x
                    for k, x in values[0].items()
                }
            elif values[0].dim() == 2:  # (S, L) or (S, L-1): pad to the common width
                cols = width + values[0].shape[1] - batches[0].input_ids.shape[1]
                fields[f.name] = torch.cat(
                    [
                        torch.nn.functional.pad(
                            v, (0, cols - v.shape[1]), value=pads.get(f.name, 0)
                        )
                        for v in values
                    ]
                )
            else:
                fields[f.name] = torch.cat(values)
        return cls(**fields)

    @classmethod
    def from_samples(cls, samples: list, pad_token_id: int) -> "RolloutBatch":
        """Right-pad samples into a batch (see `Sample`). Each field is filled by one scatter of
        all samples' values (a per-sample copy costs ~30 us a sample: 8 ms of a 256-sample
        episode on the tiny task)."""
        if not samples:
            raise ValueError("RolloutBatch.from_samples: no samples")
        prompt_lens = [len(s.prompt_ids) for s in samples]
        response_lens = [len(s.response_ids) for s in samples]
        for row, s in enumerate(samples):
            if len(s.response_logprobs) != response_lens[row]:
                raise ValueError(
                    f"sample {row}: {response_lens[row]} response tokens but "
                    f"{len(s.response_logprobs)} log-probs"
                )
            if prompt_lens[row] < 1:
                raise ValueError(
                    f"sample {row}: empty prompt; every prompt needs at least one token (e.g. BOS)"
                )
        p, r = torch.tensor(prompt_lens), torch.tensor(response_lens)
        width, n = int((p + r).max()), len(samples)
        input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros((n, width - 1), dtype=torch.float32)
        logprobs = torch.zeros((n, width - 1), dtype=torch.float32)
        # token k of the response sits at position p + k and is predicted at entry p + k - 1
        rows, cols = _spans(torch.zeros(n, dtype=torch.long), p + r)
        input_ids[rows, cols] = torch.tensor(
            [t for s in samples for t in (*s.prompt_ids, *s.response_ids)], dtype=torch.long
        )
        response = _spans(p - 1, r)
        loss_mask[response] = torch.tensor(
            [
                m
                for s in samples
                for m in (
                    s.response_mask if s.response_mask is not None else (1.0,) * len(s.response_ids)
                )
            ],
            dtype=torch.float32,
        )
        logprobs[response] = torch.tensor(
            [lp for s in samples for lp in s.response_logprobs], dtype=torch.float32
        )
        versions = routed = None
        stamped = [row for row, s in enumerate(samples) if s.weight_versions is not None]
        if stamped:
            versions = torch.full((n, width - 1), -1, dtype=torch.long)
            at = torch.tensor(stamped)
            versions[_spans(p[at] - 1, r[at], at)] = torch.tensor(
                [v for row in stamped for v in samples[row].weight_versions], dtype=torch.long
            )
        recorded = [
            torch.as_tensor(s.routed_experts) for s in samples if s.routed_experts is not None
        ]
        if recorded:
            routed = torch.full((n, width, *recorded[0].shape[1:]), -1, dtype=torch.long)
        for row, s in enumerate(samples):  # what only some samples have
            if s.prompt_logprobs is not None:
                logprobs[row, : prompt_lens[row] - 1] = torch.tensor(
                    s.prompt_logprobs[1:], dtype=torch.float32
                )
            if routed is not None and s.routed_experts is not None:
                experts = torch.as_tensor(s.routed_experts)
                routed[row, : len(experts)] = experts.long()
        return cls(
            input_ids=input_ids,
            prompt_lengths=p,
            response_lengths=r,
            loss_mask=loss_mask,
            infer_logprobs=logprobs,
            prompt_index=torch.tensor([s.prompt_index for s in samples], dtype=torch.long),
            texts=[s.text for s in samples],
            prompt_texts=[s.prompt_text for s in samples],
            finish_reasons=[s.finish_reason for s in samples],
            metadata=[dict(s.metadata) for s in samples],
            weight_versions=versions,
            routed_experts=routed,
        )


def _spans(starts: torch.Tensor, lengths: torch.Tensor, rows=None) -> tuple:
    """(rows, cols) indexing, row after row, entries starts[i] .. starts[i] + lengths[i] - 1 of
    row rows[i] (default: row i). The row of each entry comes from numpy's repeat: torch's
    `repeat_interleave` with a tensor of repeats runs as a parallel loop that waits for torch's
    other intra-op thread (measured on 2 cores at load 7-15: 2-17 ms a call against ~10 us)."""
    k = torch.from_numpy(numpy.repeat(numpy.arange(len(lengths)), lengths.numpy()))
    offsets = torch.cumsum(lengths, 0) - lengths  # where each span begins in the flat order
    cols = torch.arange(int(lengths.sum())) - offsets[k] + starts[k]
    return (k if rows is None else rows[k]), cols
