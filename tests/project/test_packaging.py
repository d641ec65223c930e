"""The wheel carries the schema and the licence: build it, install it into a
fresh venv, and run Ledger.init() from there, far from the source tree. The
sdist carries the licence and what the test suite reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# The module's servers are started once: its tests stay on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_packaging")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    (whl,) = out.glob("idemctl-*.whl")
    return whl


def test_wheel_contains_schema_and_py_typed(wheel):
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert "idemctl/schema/sqlite/0001_recipe.sql" in names
    assert "idemctl/schema/sqlite/0002_idemctl_v1.sql" in names
    assert "idemctl/schema/postgres/0001_recipe.sql" in names
    assert "idemctl/schema/postgres/0002_idemctl_v1.sql" in names
    assert "idemctl/schema/mysql/0001_idemctl_v2.sql" in names
    assert "idemctl/py.typed" in names
    # The monitoring files `idemctl monitoring` prints, as in the source tree.
    for shipped in ("idemctl/monitoring/rules.yml", "idemctl/monitoring/dashboard.json"):
        assert zipfile.ZipFile(wheel).read(shipped) == (ROOT / shipped).read_bytes()
    assert (ROOT / "schema" / "sqlite" / "0001_recipe.sql").read_bytes() == zipfile.ZipFile(wheel).read(
        "idemctl/schema/sqlite/0001_recipe.sql"
    )


def test_wheel_carries_the_licence(wheel):
    import zipfile

    whl = zipfile.ZipFile(wheel)
    assert whl.read("idemctl-0.1.0.dist-info/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    metadata = whl.read("idemctl-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: MIT" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()


def test_licence_is_mit_for_the_idemctl_authors():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License\n\nCopyright (c) 2026 the idemctl authors\n")


def test_sdist_carries_the_licence_and_what_the_tests_read(tmp_path):
    import tarfile

    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    (sdist,) = tmp_path.glob("idemctl-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in ("LICENSE", "README.md", "tests/vectors/fingerprint.json", "docs/cli.md", ".ci/run"):
        assert needed in names, needed


def test_installed_wheel_initialises_a_ledger_from_its_own_schema(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    script = (
        "import idemctl, idemctl.schema as s;"
        "ledger = idemctl.Ledger.open('ledger.db');"
        "print(ledger.init().describe());"
        "print(s.schema_root());"
        "print(idemctl.__file__)"
    )
    done = subprocess.run([str(py), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    described, schema_root, package_file = done.stdout.splitlines()
    assert described == "created (schema version 3)"
    assert str(venv) in schema_root and schema_root.endswith(os.path.join("idemctl", "schema"))
    assert str(venv) in package_file
    assert (tmp_path / "ledger.db").exists()
    # The console script and `python -m idemctl` are installed and answer.
    version = subprocess.run([str(venv / "bin" / "idemctl"), "--version"], env=env, capture_output=True, text=True)
    assert version.returncode == 0, version.stderr
    assert "0.1.0" in version.stdout
    module = subprocess.run(
        [str(py), "-m", "idemctl", "--version"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert module.returncode == 0 and module.stdout == version.stdout


@pytest.mark.parametrize(
    ("module", "missing", "message"),
    [
        (
            "idemctl.prometheus",
            "prometheus_client",
            "idemctl.prometheus needs the Prometheus client: pip install 'idemctl[prometheus]' "
            "(prometheus_client is missing)",
        ),
        (
            "idemctl.otel",
            "opentelemetry",
            "idemctl.otel needs the OpenTelemetry API: pip install 'idemctl[otel]' (opentelemetry is missing)",
        ),
    ],
)
def test_importing_an_integration_without_its_extra_names_the_extra_to_install(module, missing, message):
    # A Python where the extra's package is not installed: its import fails as it would there.
    blocked = (
        "import sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == {missing!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "try:\n"
        f"    import {module}\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc.name, exc, sep='|')\n"
    )
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=ROOT)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"{missing}|{message}\n"
