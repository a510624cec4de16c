"""The ground floor: what every other chatgen package uses, importing nothing of chatgen outside
this package.

rollout.py (RolloutBatch, the one batch type from generation to every algorithm), checkpoint_io.py
(atomic files and directories, checkpoint shards and metadata), jsonl.py (JSONL input with errors
naming file and line), distributed.py (torch.distributed rendezvous on loopback), tensors.py (numel,
unflatten, select, the sync bucket size), metrics.py (reduce_metrics), imports.py (import_class),
quiet.py (the known-harmless third-party notices filtered at their source; `chatgen -v` turns it
off). Importing this package imports none of them.
"""
