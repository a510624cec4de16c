"""A quiet terminal: the notices of third-party libraries that are known to be harmless on chatgen's
stack are filtered where they come from, so that a run prints chatgen's own lines and whatever else
is news.

    from chatgen.core import quiet
    quiet.apply()          # first thing in a process, before torch / vLLM / megatron-core are imported
    quiet.verbose()        # True under `chatgen -v ...` or CHATGEN_VERBOSE=1: no filter, more of chatgen's detail

The CLI applies it (chatgen.cli.main), so does every Ray worker of a run
(chatgen.rlhf.runtime.ModelWorker, which inherits CHATGEN_VERBOSE) and every example script. Each
filter names the library's module and the notice: a warning's category and text, a logger's message.
Anything else those modules say, and everything any other library says, still shows. vLLM's NUMA
notice comes from C++, out of reach of Python's filters; chatgen.generation.vllm.adapter quiets that
one call (`verbose()` decides there too).
"""

import logging
import os
import re
import warnings

VERBOSE = "CHATGEN_VERBOSE"  # "1": nothing filtered (set by `chatgen -v`; Ray workers inherit CHATGEN_ variables)

# (category, message regex, module regex) of each filtered warning, and why it is harmless
WARNINGS = [
    # megatron-core's fused CUDA kernels are optional extras; chatgen builds the local layer spec
    # with torch's norms and optimizers by design (on CPU the extras cannot exist)
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed", r"megatron\."),
    # megatron-core's own default (cuda_graph_scope="full") warns against itself; chatgen captures
    # no CUDA graphs
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config"),
    # megatron-core's optimizer zeroes `.grad` on every parameter of a group, the distributed
    # optimizer's views of its shards included, and torch warns about the read on a view (nothing is
    # lost: they hold no grads)
    (
        UserWarning,
        r"The \.grad attribute of a Tensor that is not a leaf Tensor",
        r"megatron\.core\.optimizer",
    ),
    # megatron-core's DDP and distributed optimizer call the collectives by their long-standing
    # names, which torch 2.13 renamed; the deprecated names still do the same
    (
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        r"torch\.distributed\.c10d_logger",
    ),
    # a CUDA stream setting, advice for GPUs; on CPU (gloo) there is no stream to set (every TP > 1
    # trainer rank)
    (
        UserWarning,
        r"When using async grad allreduce it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS",
        r"megatron\.core\.tensor_parallel\.layers",
    ),
    # a resume reads megatron-core's distributed checkpoint: megatron calls torch's long-standing
    # loader name, and torch's planner warns about the ShardedTensor type megatron's checkpoints are
    # built on (3 lines per resume)
    (
        FutureWarning,
        r"`load_state_dict` is deprecated and will be removed",
        r"megatron\.core\.dist_checkpointing\.strategies\.torch",
    ),
    (
        FutureWarning,
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"torch\.distributed\.checkpoint\.",
    ),
    # vLLM scans every imported module's attributes for Triton kernels and touches
    # torch.distributed.reduce_op
    (
        FutureWarning,
        r"`torch\.distributed\.reduce_op` is deprecated",
        r"vllm\.triton_utils\.dispatcher",
    ),
]

# logger name -> the message (regex, matched at its start) dropped from that logger; its other
# messages show. Both libraries configure their loggers late or not at all (vLLM when an engine
# starts, Ray not with configure_logging=False), so these went through Python's last-resort handler
# whatever their levels say.
LOGGED = {
    # torch brings Triton along; vLLM's CPU backend uses its own C++ kernels, not Triton's
    "vllm.triton_utils.importing": r"Triton is installed, but doesn't include CPU backend",
    # the run's own local Ray turned its token authentication on (good news; "... is disabled ..."
    # still shows)
    "ray._private.authentication.authentication_token_setup": r"Token authentication is enabled",
}


class _Drop(logging.Filter):
    """Drops the records whose message matches `pattern` (at its start)."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record) -> bool:
        return not self.pattern.match(record.getMessage())


def verbose() -> bool:
    return os.environ.get(VERBOSE, "") not in ("", "0")


def apply() -> None:
    """Install the filters in this process (nothing under verbose()); safe to call again. vLLM
    logs errors only (VLLM_LOGGING_LEVEL=ERROR unless set): its INFO and WARNING lines of an
    engine start-up (~40 per engine: arguments, compilation, cache sizes, performance hints for a
    tuned CPU setup) are its own diary. Set before the libraries are imported: both variables are
    read then."""
    if verbose():
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # transformers' bar per shard it reads or writes
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for category, message, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, pattern in LOGGED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(pattern))
