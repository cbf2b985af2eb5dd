"""Every NEPS_BCAST_* variable: read at call time, validated, documented in docs/."""

from __future__ import annotations

from pathlib import Path

import pytest

from neps_bcast.config import INTERNAL, VARIABLES, Settings
from neps_bcast.errors import SettingsError
from neps_bcast.transport.auth import ENV_SECRET

CONFIGURATION = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


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
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"NEPS_BCAST_WAIT_TIMEOUT_S": raw})
    text = str(info.value)
    assert f"NEPS_BCAST_WAIT_TIMEOUT_S={raw!r}" in text
    assert "HINT: unset NEPS_BCAST_WAIT_TIMEOUT_S" in text


def test_every_variable_has_a_field_and_is_documented() -> None:
    readme = CONFIGURATION.read_text()
    fields = set(Settings.__dataclass_fields__)
    assert {v.field for v in VARIABLES} == fields
    for var in VARIABLES:
        assert f"`{var.name}`" in readme, f"docs/configuration.md does not document {var.name}"
    assert f"`{ENV_SECRET}`" in readme
    for name in INTERNAL:
        assert f"`{name}`" in readme, f"docs/configuration.md does not mention the internal {name}"


def test_a_heartbeat_not_well_under_the_grace_is_refused() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"NEPS_BCAST_HEARTBEAT_S": "100", "NEPS_BCAST_LEASE_GRACE_S": "300"})
    text = str(info.value)
    assert (
        "NEPS_BCAST_HEARTBEAT_S=100 is not less than a third of NEPS_BCAST_LEASE_GRACE_S=300"
        in text
    )
    assert "HINT: make the heartbeat shorter" in text
    assert Settings.from_env({"NEPS_BCAST_HEARTBEAT_S": "99", "NEPS_BCAST_LEASE_GRACE_S": "300"})


def test_a_bad_count_is_refused_like_a_bad_number_of_seconds() -> None:
    with pytest.raises(SettingsError, match=r"NEPS_BCAST_MAX_RETRIES='-2' is not a whole number"):
        Settings.from_env({"NEPS_BCAST_MAX_RETRIES": "-2"})
