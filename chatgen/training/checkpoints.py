"""`MegatronModule`'s checkpoints in three formats: its own megatron-core distributed checkpoints
(saved and loaded at any TP x PP x DP), the weights-only Megatron shards of `chatgen convert --to
megatron` (loaded at their TP and PP), and HF directories (converted to this rank's shard as they
load).

`Checkpoints` is a mixin of `chatgen.training.megatron_module.MegatronModule`: it reads the model,
optimizer, spec and parallel ranks the class sets up.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from chatgen.core.checkpoint_io import (
    copy_hf_side_files,
    ranks_write_directory,
    read_hf_safetensors,
    read_megatron_meta,
    read_megatron_shard,
    write_megatron_meta,
)
from chatgen.models import layout
from chatgen.models.lora_format import CHECKPOINT_DIR
from chatgen.module import remote
from chatgen.training import dist_checkpoint, lora, lora_peft


class Checkpoints:
    """save_checkpoint / load_checkpoint (hooks a subclass may override) and what they read and
    write."""

    @remote("all")
    def save_checkpoint(self, path) -> str:
        """Write weights + optimizer state to directory `path` atomically, as a megatron-core
        distributed checkpoint: each rank writes its own shards, and `load_checkpoint` reads it back
        at any TP x PP x DP (chatgen/training/dist_checkpoint.py). Returns the path.

        Layout: chatgen_megatron.json (HF config, TP, PP, DP, padded vocab, iteration) beside
        megatron's files (metadata.json, .metadata, __<rank>_<n>.distcp, common.pt), and the
        tokenizer / generation files of `load` (chatgen.core.checkpoint_io.HF_SIDE_FILES), so
        `chatgen serve` and `convert --to hf` need no other. Ranks write into the staging directory
        of chatgen.core.checkpoint_io, then rank 0 moves it into place, so a crash never leaves a
        half-written `path`. A model that has not stepped yet has no optimizer state to save: its
        checkpoint holds the weights.
        """
        stepped = self.iteration > 0
        self.onload()
        with ranks_write_directory(path) as tmp:
            dist_checkpoint.save(self._sharded_state_dict(optimizer=stepped, loading=False), tmp)
            # the adapter in PEFT's format too: convert --to hf merges it, PEFT loads it
            if self.config.lora.rank:
                lora_peft.export_peft(self, tmp / CHECKPOINT_DIR)
            if dist.get_rank() == 0:
                write_megatron_meta(
                    tmp,
                    self.hf_config,
                    self.tp,
                    self.pp,
                    self.padded_vocab_size,
                    self.iteration,
                    optimizer=stepped,
                    distributed=True,
                    dp=self.dp,
                    ep=self.ep,
                )
                if self.config.load:  # its tokenizer and generation files: serves, exports whole
                    copy_hf_side_files(self.config.load, tmp)
        return str(path)

    @remote("all")
    def load_checkpoint(self, path) -> None:
        """Load weights from an HF directory (converted to this rank's shard) or a chatgen Megatron
        checkpoint.

        A checkpoint this trainer saved loads at any TP x PP x DP (the padded vocab must agree: it
        depends on TP and make_vocab_size_divisible_by) and restores iteration and optimizer state
        with the weights; one written by `chatgen convert --to megatron` (weights only) must have
        this run's TP and PP.
        """
        path = Path(path)
        meta = read_megatron_meta(path)
        self.onload()
        if meta is not None and meta.get("distributed"):
            if meta["padded_vocab_size"] != self.padded_vocab_size:
                raise ValueError(
                    f"{path}: saved with the vocab padded to {meta['padded_vocab_size']} rows (TP "
                    f"{meta['tensor_model_parallel_size']}), this run pads it to {self.padded_vocab_size} (TP "
                    f"{self.tp}, make_vocab_size_divisible_by={self.config.make_vocab_size_divisible_by}); set "
                    "make_vocab_size_divisible_by so that both agree, or go through HF: chatgen convert --to hf"
                )
            stepped = bool(meta.get("optimizer"))
            wanted = self._sharded_state_dict(optimizer=stepped, loading=True)
            state = _read_checkpoint_file(
                lambda directory: dist_checkpoint.load(wanted, directory), path
            )
            self.model.load_state_dict(state["model"])
            if stepped:
                self.optimizer.load_state_dict(state["optimizer"])
            else:
                self.optimizer.reload_model_params()  # the fp32 main weights follow the loaded ones
            self.iteration = meta.get("iteration", 0)
            return
        if meta is not None:
            have = (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"])
            if have != (self.tp, self.pp):
                raise ValueError(
                    f"{path}: checkpoint has TP, PP = {have} but this run uses {(self.tp, self.pp)}; "
                    f"reshard it: chatgen convert --to hf --input {path} --output HF_DIR"
                )
            # written by chatgen before megatron's optimizer: plain AdamW's state
            if meta.get("optimizer"):
                raise ValueError(
                    f"{path}: its optimizer state (optim_tp*_pp*.pt) is the format of an older chatgen, "
                    "which this trainer cannot continue; start from its weights: chatgen convert --to hf "
                    f"--input {path} --output HF_DIR, then load HF_DIR"
                )
            self._load_canonical_state(
                _read_checkpoint_file(read_megatron_shard, path, self.tp_rank, self.pp_rank),
                source=str(path),
            )
            self.iteration = meta.get("iteration", 0)
            return
        state = {}
        params = self._stage_params()
        names = {n for sp, _ in params for n in sp.hf_names}
        hf = read_hf_safetensors(path, self.spec.tie_word_embeddings, names=names)
        for sp, canonical in params:
            missing = [n for n in sp.hf_names if n not in hf]
            if missing:
                raise KeyError(f"{path}: HF checkpoint lacks {missing} (Megatron {sp.local_name})")
            shards = layout.to_megatron_shards(
                sp.kind,
                [hf[n] for n in sp.hf_names],
                self.spec,
                self.tp,
                self.padded_vocab_size,
                what=sp.hf_names[0],
            )
            state[canonical] = shards[self.tp_rank]
        self._load_canonical_state(state, source=str(path))

    def _sharded_state_dict(self, optimizer: bool, loading: bool) -> dict:
        """What a distributed checkpoint holds: the model's megatron ShardedTensors (global names
        and offsets, so any layout can read them) and, with `optimizer`, the distributed
        optimizer's state in the same model space (`fully_reshardable`: gathered to the DP
        group's first rank, through host memory, when saved)."""
        model = self.model.sharded_state_dict()
        state = {"model": model}
        if optimizer:
            # megatron asks the optimizer for its state dict first: AdamW's state must exist
            if loading:
                for chained in self.optimizer.chained_optimizers:
                    chained._init_optimizer_states_with_dummy_values()  # megatron's way; overwritten by the load
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model,
                is_loading=loading,
                metadata={
                    "distrib_optim_sharding_type": "fully_reshardable",
                    "distrib_optim_fully_reshardable_mem_efficient": True,
                },
            )
        return state

    def _stage_params(self, ep_rank: int | None = None) -> list:
        """[(layout.StageParam, its name in a checkpoint)] of this rank's stage at EP rank
        `ep_rank` (this rank's by default). A checkpoint holds every expert of a stage, numbered
        globally (the layout at EP = 1)."""
        everything = {
            sp.hf_names[0]: sp.local_name
            for sp in layout.stage_params(self.spec, self.pp, self.pp_rank)
        }
        rank = self.ep_rank if ep_rank is None else ep_rank
        return [
            (sp, everything[sp.hf_names[0]])
            for sp in layout.stage_params(self.spec, self.pp, self.pp_rank, self.ep, rank)
        ]

    @torch.no_grad()
    def _load_canonical_state(self, state: dict, source: str) -> None:
        params = self._params
        expected = {
            self._to_module_name(sp.local_name): canonical for sp, canonical in self._stage_params()
        }
        missing = sorted(n for n in set(params) - set(expected) if not lora.is_adapter_param(n))
        if missing:
            raise RuntimeError(
                f"{source}: model parameters {missing} have no mapping in chatgen/models/"
                f"{self.spec.family}.py; extend its param_mappings"
            )
        for module_name, canonical in expected.items():
            if canonical not in state:
                raise KeyError(
                    f"{source}: no tensor for {canonical} (stage {self.pp_rank}, TP rank {self.tp_rank})"
                )
            src, dst = state[canonical], params[module_name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(
                    f"{source}: {canonical} has shape {tuple(src.shape)}, the model expects "
                    f"{tuple(dst.shape)} (TP={self.tp}, PP={self.pp})"
                )
            dst.copy_(src)
        # the optimizer steps fp32 main weights: they follow the loaded ones
        if self.optimizer is not None:
            self.optimizer.reload_model_params()


def _read_checkpoint_file(read, path, *args, **kwargs):
    """`read(path, ...)` with a damaged file reported by its name rather than by the reader's
    internals."""
    try:
        return read(path, *args, **kwargs)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors / torch.distributed.checkpoint raise many types for a damaged file
        raise ValueError(
            f"{path}: cannot be read, the checkpoint is damaged ({type(e).__name__}: {e}); resume from "
            "an earlier checkpoint or restore the file"
        ) from e
