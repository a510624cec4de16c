"""Unit tests for chatgen.core.checkpoint_io (pytest tests/unit/test_checkpoint_io.py)."""

import pytest
import torch
from safetensors.torch import save_file

from chatgen.core.checkpoint_io import (
    atomic_directory,
    megatron_shard_file,
    ranks_write_directory,
    read_hf_safetensors,
    read_megatron_shard,
)


def test_atomic_directory_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "sub" / "model"
    with atomic_directory(out) as tmp:
        (tmp / "a.txt").write_text("a")
        assert not out.exists()  # nothing visible under the final name while writing
    assert (out / "a.txt").read_text() == "a"
    assert (out.stat().st_mode & 0o777) == 0o755

    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError):
        with atomic_directory(failed) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("crash while writing")
    assert not failed.exists()
    # the temporary directory is gone too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]


def test_ranks_write_directory_replaces_whole_or_leaves_the_old(tmp_path):
    """The trainers' checkpoint directory (a one-rank gloo world here): a failure inside keeps
    the old checkpoint; a success replaces it whole."""
    import torch.distributed as dist

    from chatgen.core.distributed import join_world

    owned = not dist.is_initialized()
    join_world()
    try:
        out = tmp_path / "ckpt"
        out.mkdir()
        (out / "old.txt").write_text("old")
        with pytest.raises(RuntimeError):
            with ranks_write_directory(out) as tmp:
                (tmp / "half.txt").write_text("half")
                raise RuntimeError("a rank failed while writing")
        assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
        with ranks_write_directory(out) as tmp:
            (tmp / "new.txt").write_text("new")
            assert not (out / "new.txt").exists()  # nothing under the final name while writing
        assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left
    finally:
        if owned:
            dist.destroy_process_group()


def test_read_hf_safetensors_merges_files_filters_and_unties(tmp_path):
    emb, norm = torch.randn(5, 4), torch.randn(4)
    save_file({"lm_head.weight": emb}, str(tmp_path / "model-00001.safetensors"))
    save_file({"model.norm.weight": norm}, str(tmp_path / "model-00002.safetensors"))

    tied = read_hf_safetensors(tmp_path, tie_word_embeddings=True)
    assert torch.equal(tied["model.embed_tokens.weight"], emb) and torch.equal(
        tied["model.norm.weight"], norm
    )
    assert "model.embed_tokens.weight" not in read_hf_safetensors(
        tmp_path, tie_word_embeddings=False
    )
    assert set(read_hf_safetensors(tmp_path, False, names={"model.norm.weight"})) == {
        "model.norm.weight"
    }
    # a stage that asks only for the embedding (MegatronModule reads just its stage's names) still gets the
    # tied matrix stored under the head's name
    only_emb = read_hf_safetensors(tmp_path, True, names={"model.embed_tokens.weight"})
    assert torch.equal(only_emb["model.embed_tokens.weight"], emb)

    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        read_hf_safetensors(tmp_path / "missing", tie_word_embeddings=False)


def test_megatron_shard_round_trip(tmp_path):
    state = {"decoder.final_layernorm.weight": torch.randn(4)}
    save_file(state, str(megatron_shard_file(tmp_path, t=1, p=0)))
    assert (tmp_path / "model_tp1_pp0.safetensors").exists()
    assert torch.equal(
        read_megatron_shard(tmp_path, t=1, p=0)["decoder.final_layernorm.weight"],
        state["decoder.final_layernorm.weight"],
    )
