"""Shared entry-point behaviour: a user error is one line on stderr and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by the user's input (config, data, paths, checkpoints): no traceback."""
    from pydantic import ValidationError

    from intellect_jax.aot.targets import AotUnavailable
    from intellect_jax.data.errors import DataError
    from intellect_jax.coordinator.journal import JournalError
    from intellect_jax.coordinator.protocol import CoordinatorUnavailable, RegistrationRefused
    from intellect_jax.diloco.parts import DilocoError
    from intellect_jax.net.errors import AuthError, NetError
    from intellect_jax.model.config import ConfigError
    from intellect_jax.model.hf import HFFormatError
    from intellect_jax.trainer.checkpoint import CheckpointError
    from intellect_jax.trainer.loop import RunDirError

    return (ConfigError, DataError, HFFormatError, CheckpointError, RunDirError, ValidationError,
            RegistrationRefused, CoordinatorUnavailable, JournalError, AuthError, NetError, DilocoError,
            FileNotFoundError, FileExistsError, PermissionError, AotUnavailable)


def run_main(main: Callable[[], Any]) -> int:
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
