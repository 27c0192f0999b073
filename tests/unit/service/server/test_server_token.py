"""Where the API token comes from: env, --token-file, or a generated 0600 file in the data dir."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from service.server import holder_id, resolve_api_token
from service.settings import SettingsError, load_settings


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTRAIN_API_TOKEN", raising=False)
    monkeypatch.delenv("ELASTRAIN_TOKEN_FILE", raising=False)


def test_generated_once_with_mode_0600_then_reused(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    token, where = resolve_api_token(settings)
    path = tmp_path / "api-token"
    assert where == f"{path} (generated)" and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_api_token(settings) == (token, str(path))


def test_environment_wins_and_is_never_echoed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTRAIN_API_TOKEN", "e" * 20)
    token, where = resolve_api_token(load_settings(data_dir=tmp_path))
    assert token == "e" * 20 and where == "ELASTRAIN_API_TOKEN"
    assert not (tmp_path / "api-token").exists()


def test_token_file(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text("f" * 24 + "\n")
    assert resolve_api_token(load_settings(data_dir=tmp_path, token_file=good)) == ("f" * 24, str(good))
    with pytest.raises(SettingsError, match="does not exist"):
        resolve_api_token(load_settings(data_dir=tmp_path, token_file=tmp_path / "missing"))
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(SettingsError, match="shorter than 16"):
        resolve_api_token(load_settings(data_dir=tmp_path, token_file=short))


def test_leader_id_is_stable_per_data_dir_and_port(tmp_path: Path) -> None:
    a = holder_id(load_settings(data_dir=tmp_path / "a"))
    assert a == holder_id(load_settings(data_dir=tmp_path / "a"))
    assert a != holder_id(load_settings(data_dir=tmp_path / "b"))
    assert a != holder_id(load_settings(data_dir=tmp_path / "a", port=9000))
