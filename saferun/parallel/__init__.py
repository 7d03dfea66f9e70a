"""Parallelism: the strategy object that owns a launch's parallelism and that the loop calls at
named points (`strategy`), how the ranks agree on requests and stops (`agreement`), DDP (`ddp`),
FSDP2 sharding (`fsdp`) and the device mesh (`mesh`). The process group and the collectives
they use are `saferun.distributed`; the settings nodes are in `saferun.config`."""
