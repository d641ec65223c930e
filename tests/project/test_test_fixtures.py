"""The test fixtures that start servers say why one did not start."""

from __future__ import annotations

import stat

import pytest

from tests import galera


def test_a_galera_node_whose_install_fails_shows_what_the_installer_said(tmp_path, monkeypatch):
    failing = tmp_path / "mariadb-install-db"
    failing.write_text(
        "#!/bin/sh\necho 'mariadb-install-db: Cannot change ownership of the database directories' >&2\nexit 1\n"
    )
    failing.chmod(failing.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(galera, "INSTALL_DB", str(failing))
    cluster = galera.GaleraCluster(galera=False)
    try:
        with pytest.raises(RuntimeError) as failed:
            cluster._install(tmp_path / "data")
    finally:
        galera.shutil.rmtree(cluster.base, ignore_errors=True)
    assert str(failed.value) == (
        f"{failing} exited with 1 for {tmp_path / 'data'}: "
        "mariadb-install-db: Cannot change ownership of the database directories"
    )
