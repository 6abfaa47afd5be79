"""The wheel must hold every subpackage: an editable install hides a package missing from pyproject."""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {
    "stagetrace": "src/stagetrace",
    "stagetrace.collectors": "collectors",
    "stagetrace.exporters": "exporters",
    "stagetrace.dashboards": "dashboards",
}


def _packages_on_disk() -> set[str]:
    found = set()
    for package, folder in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    return found


def test_pyproject_lists_every_package_and_folder():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # the data folders too (dashboards/generated, ...): setuptools warns about each one it installs unlisted
    data = {
        f"{package}.{pattern.split('/')[0]}"
        for package, patterns in tool["package-data"].items()
        for pattern in patterns
    }
    assert set(tool["packages"]) == _packages_on_disk() | data
    assert tool["package-dir"] == PACKAGE_DIRS


def _clean_copy(dest: Path) -> None:
    """Tracked and untracked-but-not-ignored files: what a fresh clone would hold, without build leftovers."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def test_wheel_from_a_clean_copy_imports_every_subpackage(tmp_path):
    src, dist, env = tmp_path / "src", tmp_path / "dist", tmp_path / "venv"
    _clean_copy(src)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", dist, src], check=True, capture_output=True, text=True
    )
    assert "Warning" not in built.stdout + built.stderr  # pip install . stays quiet: no setuptools deprecations
    wheel = next(dist.glob("stagetrace-*.whl"))
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel],
        check=True,
        capture_output=True,
    )
    # Third-party dependencies come from the test environment; stagetrace itself only from the wheel.
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "deps-from-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    modules = sorted(_packages_on_disk())
    check = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(env)!r}), module.__file__\n"
        "import stagetrace.exporters.clickhouse, stagetrace.cli\n"
        "print('ok')\n"
    )
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([python, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=clean_env)
    assert result.stdout.strip() == "ok", result.stderr
    script = subprocess.run([env / "bin" / "stagetrace", "--version"], capture_output=True, text=True, env=clean_env)
    assert script.stdout.startswith("stagetrace "), script.stderr


def test_the_readme_otlp_example_is_installed_by_the_otlp_extra():
    """The docs' plain-SDK example imports the official OTLP exporters: `pip install '.[otlp]'` brings them, and the
    README's front page says so too."""
    readme = (ROOT / "docs" / "otlp.md").read_text()
    assert "pip install '.[otlp]'" in (ROOT / "README.md").read_text()
    imported = set(re.findall(r"from opentelemetry\.exporter\.otlp\.proto\.(\w+)\.trace_exporter import", readme))
    assert imported == {"grpc", "http"}
    assert "pip install '.[otlp]'" in readme
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["otlp"]
    names = {re.split(r"[<>=!~\[ ]", requirement)[0] for requirement in extra}
    assert names == {f"opentelemetry-exporter-otlp-proto-{protocol}" for protocol in imported}
