"""Every NEPS_BCAST_* variable: read at call time, validated, documented in README."""

from __future__ import annotations

from pathlib import Path

import pytest

from neps_bcast.config import INTERNAL, VARIABLES, Settings
from neps_bcast.errors import LaunchError
from neps_bcast.transport.auth import ENV_SECRET

README = Path(__file__).resolve().parents[1] / "README.md"


def test_defaults() -> None:
    assert Settings.from_env({}) == Settings()


def test_values_are_read_when_asked_not_at_import() -> None:
    settings = Settings.from_env(
        {"NEPS_BCAST_JOIN_TIMEOUT_S": "12.5", "NEPS_BCAST_BACKEND": "gloo"}
    )
    assert settings.join_timeout_s == 12.5
    assert settings.backend == "gloo"


@pytest.mark.parametrize("raw", ["soon", "0", "-3"])
def test_a_bad_number_names_the_variable_and_the_fix(raw: str) -> None:
    with pytest.raises(LaunchError) as info:
        Settings.from_env({"NEPS_BCAST_WAIT_TIMEOUT_S": raw})
    text = str(info.value)
    assert f"NEPS_BCAST_WAIT_TIMEOUT_S={raw!r}" in text
    assert "HINT: unset NEPS_BCAST_WAIT_TIMEOUT_S" in text


def test_every_variable_has_a_field_and_is_in_readme() -> None:
    readme = README.read_text()
    fields = set(Settings.__dataclass_fields__)
    assert {v.field for v in VARIABLES} == fields
    for var in VARIABLES:
        assert f"`{var.name}`" in readme, f"README does not document {var.name}"
    assert f"`{ENV_SECRET}`" in readme
    for name in INTERNAL:
        assert f"`{name}`" in readme, f"README does not mention the internal {name}"
