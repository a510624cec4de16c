"""Which torch.distributed backend the cross-process weight channel takes (chatgen.param_sync.wire): NCCL only
between two different GPUs; gloo when either end is on the host or both share one GPU (NCCL cannot pair two ranks
on one device: a trainer and `chatgen serve --control` on the same GPU).

    .venv/bin/python -m pytest tests/unit/test_sync_group_choice.py
"""

from chatgen.param_sync.wire import nccl_among, where


def test_nccl_only_between_two_different_gpus():
    gpu0, gpu1 = "node-a:GPU-1111", "node-a:GPU-2222"
    assert nccl_among([gpu0, gpu1]) and nccl_among([gpu1, "node-b:GPU-1111"])
    # a broadcast to two engines on GPUs of their own
    assert nccl_among([gpu0, gpu1, "node-b:GPU-1111"])
    assert not nccl_among([gpu0, gpu0])  # one GPU shared by both processes
    assert not nccl_among([gpu0, gpu1, gpu0])  # a trainer and one of the engines on one GPU
    assert (
        not nccl_among(["cpu", gpu0])
        and not nccl_among([gpu0, "cpu"])
        and not nccl_among(["cpu", "cpu"])
    )


def test_this_cpu_machine_says_cpu():
    import torch

    assert where() == "cpu" or (torch.cuda.is_available() and ":" in where())
