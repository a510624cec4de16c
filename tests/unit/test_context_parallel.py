"""Context parallel on this CPU stack (chatgen/training/context_parallel.py, docs/long_context.md):
the fsdp trainer refuses context_parallel_size > 1 on CPU naming the key, and the two measured
reasons still hold (each test fails loudly when a torch or megatron-core upgrade lifts its reason:
then build and test the CPU path).

    python -m pytest tests/unit/test_context_parallel.py
"""

import inspect
import subprocess
import sys
import textwrap

import pytest

from chatgen.config import ConfigError, load_model_config
from chatgen.training.config import FSDPConfig
from chatgen.training.context_parallel import CPU_REFUSAL


def test_the_fsdp_trainer_refuses_context_parallel_on_cpu_naming_the_key(tmp_path):
    from chatgen.training.fsdp_module import FSDPModule

    trainer = FSDPModule({"load": str(tmp_path), "context_parallel_size": 2})
    with pytest.raises(ValueError) as e:
        trainer.init()
    message = str(e.value)
    assert "context_parallel_size: 1" in message and "CUDA only" in message
    assert "TEDotProductAttention" in message  # the measured reasons travel with the refusal


def test_a_context_parallel_size_below_one_is_refused():
    with pytest.raises(ConfigError, match="context_parallel_size"):
        load_model_config(None, FSDPConfig, {"context_parallel_size": 0})


def test_torch_context_parallel_attention_still_has_no_cpu_kernel():
    probe = textwrap.dedent(
        """
        import torch, torch.distributed as dist, torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
        x, w = torch.randn(1, 2, 16, 8), torch.nn.Parameter(torch.randn(8, 8))
        try:
            with context_parallel(init_device_mesh("cpu", (1,)), buffers=[x], buffer_seq_dims=[2]):
                F.scaled_dot_product_attention(x @ w, x @ w, x, is_causal=True)
            print("RAN")
        except NotImplementedError as e:
            print(e)
        dist.destroy_process_group()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    ).stdout
    assert "RAN" not in out, "torch's CP attention runs on CPU now: build the CPU path and its test"
    reason = "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding"
    assert reason in out and reason in CPU_REFUSAL


def test_megatron_core_local_attention_still_refuses_context_parallel():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    reason = "Context parallelism is only supported by TEDotProductAttention!"
    assert reason in inspect.getsource(DotProductAttention.__init__)
    assert reason in CPU_REFUSAL
