"""FSDPModule's checkpoints (`save_checkpoint` / `load_checkpoint`): a torch.distributed.checkpoint of
weights and optimizer state that loads at another DP, beside an HF checkpoint of the weights, so the
directory also serves and exports as it is (docs/fsdp_backend.md)."""

import json
from pathlib import Path

import torch.distributed as dist

from chatgen.core.checkpoint_io import copy_hf_side_files, ranks_write_directory
from chatgen.module import remote

FSDP_META = (
    "chatgen_fsdp.json"  # marks a checkpoint an FSDPModule wrote: iteration, optimizer saved
)


class FSDPCheckpoints:
    """The checkpoint methods of FSDPModule (a mixin: it uses the trainer's model, optimizers,
    config, hf_weights and iteration counters)."""

    @remote("all")
    def save_checkpoint(self, path) -> str:
        """Write weights + optimizer state to directory `path` atomically: a
        torch.distributed.checkpoint (each rank writes its shards; it loads at another DP) beside
        chatgen_fsdp.json (iteration), and an HF checkpoint of the weights (`_write_hf`) with the
        model's config.json and the tokenizer / generation files of `load`, so the directory also
        serves and exports as it is. Ranks write into a staging directory that rank 0 moves into
        place. Returns the path."""
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.onload()
        with ranks_write_directory(path) as tmp:
            model_state, optim_state = get_state_dict(self.model, self.torch_optimizers)
            dcp.save(
                {"model": model_state, "optimizer": optim_state},
                storage_writer=dcp.FileSystemWriter(str(tmp / "dcp"), thread_count=1),
            )
            self._write_hf(tmp)  # merged, for a LoRA trainer: the directory serves as it is
            if self.config.lora.rank:  # and the adapter as PEFT's directory
                self.export_adapter(tmp / "adapter")
            if dist.get_rank() == 0:
                meta = dict(iteration=self.iteration, skipped_steps=self.skipped_steps, dp=self.dp)
                meta.update(lora=_lora_keys(self.config.lora))
                (tmp / FSDP_META).write_text(json.dumps(meta, indent=1))
                (tmp / "config.json").write_text(json.dumps(self.hf_config, indent=1))
                copy_hf_side_files(self.config.load, tmp)
        return str(path)

    def _write_hf(self, directory: Path) -> None:
        """The weights as an HF checkpoint in `directory` (collective; rank 0 writes): one
        safetensors file per sync bucket plus model.safetensors.index.json, so that the
        checkpoint directory serves and exports as it is (vLLM, `chatgen serve`, transformers).
        One bucket of full tensors in memory at a time."""
        from safetensors.torch import save_file

        weights = self.hf_weights()
        n, index = len(weights.plan), {}
        for i, bucket in enumerate(weights.buckets()):
            if dist.get_rank() == 0:
                name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                save_file(
                    {k: t.detach().cpu().contiguous() for k, t in bucket},
                    str(directory / name),
                    metadata={"format": "pt"},
                )
                index.update({k: name for k, _ in bucket})
        if dist.get_rank() == 0:
            (directory / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": index}, indent=1)
            )

    @remote("all")
    def load_checkpoint(self, path) -> None:
        """Restore weights, optimizer state and iteration from a checkpoint of `save_checkpoint`
        (any DP). Read without unpickling anything freely (chatgen.core.dcp.read_safely)."""
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from chatgen.core.dcp import read_safely

        path = Path(path)
        if not (path / FSDP_META).is_file():
            raise ValueError(
                f"{path}: not a checkpoint of an fsdp trainer ({FSDP_META} missing); an HF directory "
                "loads through the `load` key"
            )
        saved = json.loads((path / FSDP_META).read_text()).get("lora")
        if saved != _lora_keys(self.config.lora):  # its tensors are of that rank and targets
            raise ValueError(
                f"{self.name}: {path} holds a trainer with lora {saved}, this config has "
                f"{_lora_keys(self.config.lora)}; set the `lora:` keys as the checkpoint's"
            )
        read_safely()
        self.onload()
        model_state, optim_state = get_state_dict(self.model, self.torch_optimizers)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / "dcp")))
        set_state_dict(
            self.model,
            self.torch_optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        meta = json.loads((path / FSDP_META).read_text())
        self.iteration, self.skipped_steps = meta["iteration"], meta.get("skipped_steps", 0)


def _lora_keys(cfg) -> dict | None:
    """The `lora:` keys a checkpoint's tensors depend on (None: no LoRA)."""
    return (
        dict(rank=cfg.rank, alpha=cfg.alpha, targets=list(cfg.target_modules)) if cfg.rank else None
    )
