"""trainprobe's messages show without set-up and defer to the user's logging configuration."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
if sys.argv[1] != "none":
    logging.basicConfig(level=getattr(logging, sys.argv[1]), format="USER %(levelname)s %(message)s")
from trainprobe.engine.log import logger
logger.info("the-info-line")
logger.warning("the-warning-line")
logging.getLogger("trainprobe.metrics").info("the-metrics-line")
"""


def _stderr(mode: str, level_env: str | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINPROBE_LOG_LEVEL"}
    if level_env is not None:
        env["TRAINPROBE_LOG_LEVEL"] = level_env
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    return done.stderr.splitlines()


def test_info_shows_without_any_logging_setup() -> None:
    assert _stderr("none") == ["INFO the-info-line", "WARNING the-warning-line", "INFO the-metrics-line"]


def test_a_configured_root_level_hides_trainprobe_info_once_and_only_once() -> None:
    lines = _stderr("WARNING")
    assert "USER WARNING the-warning-line" in lines
    assert not any("the-info-line" in line for line in lines)
    assert sum("the-warning-line" in line for line in lines) == 1  # no second copy from the default handler


def test_a_configured_info_root_shows_info_through_the_users_handler() -> None:
    assert _stderr("INFO") == [
        "USER INFO the-info-line",
        "USER WARNING the-warning-line",
        "USER INFO the-metrics-line",
    ]


@pytest.mark.parametrize(("value", "expected"), [("warning", ["WARNING the-warning-line"]), ("ERROR", [])])
def test_the_environment_variable_sets_the_level(value: str, expected: list[str]) -> None:
    assert _stderr("none", level_env=value) == expected


def test_a_bad_level_in_the_environment_is_reported_and_info_is_used() -> None:
    lines = _stderr("none", level_env="LOUD")
    assert lines[0] == "WARNING TRAINPROBE_LOG_LEVEL='LOUD' is not a logging level; using INFO"
    assert "INFO the-info-line" in lines
