"""Megatron side of chatgen: MegatronModule (megatron_module.py), CPU compatibility
(cpu_compat.py), a tiny multi-process launcher (launcher.py), `chatgen convert` (convert.py) and
`chatgen check-sync` (check_sync.py). Importing this package does not import megatron-core."""
