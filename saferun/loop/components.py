"""Config nodes into objects: the default task hooks' instantiation with errors that name the
config key, and the callbacks the config asks for (callbacks, loggers, console output, audit)."""

from __future__ import annotations

from typing import Any, Mapping

from ..callbacks import Callback
from ..errors import ConfigError, SaferunError
from ..guards.sync_audit import SyncAudit
from ..loggers import LogLines, ProgressBar, want_progress_bar
from ..text import root_cause


def instantiate_node(key: str, node: Mapping[str, Any], **kwargs: Any) -> Any:
    """Hydra-instantiate the config node `key` (with `kwargs`); a failure names the key."""
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except Exception as e:
        cause: BaseException = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, SaferunError) and str(cause).startswith(key):
            raise cause from None  # the part's own refusal names its key and the fix
        raise ConfigError(f"{key}: could not build {node.get('_target_')}: {root_cause(e)}. "
                          f"Check the keys under {key}.") from None


def required_node(cfg: Any, key: str, task: str, hook: str) -> Mapping[str, Any]:
    """The config node a default hook builds from; an error if the config has none."""
    node = getattr(cfg, key)
    if node is None:
        raise SaferunError(f"{task}.{hook}() is not overridden and the config "
                           f"has no '{key}' node. Override {hook}() or set {key}._target_.")
    return node


def configured_callbacks(cfg: Any, is_main: bool, device_type: str) -> list[Callback]:
    """The `callbacks` nodes, then (on rank 0) the `logger` nodes and the console output."""
    callbacks: list[Callback] = []
    for key in ("callbacks", "logger") if is_main else ("callbacks",):
        for name, node in (getattr(cfg, key) or {}).items():
            if node is not None:
                callbacks.append(instantiate_node(f"{key}.{name}", node))
    if is_main:
        callbacks.append(ProgressBar() if want_progress_bar(cfg.trainer.progress_bar)
                         else LogLines())
    if cfg.guards.sync_audit:
        callbacks.append(SyncAudit(device_type))  # last: it sees every callback's syncs
    return callbacks
