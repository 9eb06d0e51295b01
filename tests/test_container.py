"""Containerfile: parsed by Docker's own parser (the ``dockerfile`` package) and checked
against the repository it copies from, and the offline build script that drives it. Building
takes minutes and root (``make image``); see docs/CONTAINER.md for what was built and run."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import dockerfile  # the dev extra: Docker's own parser (a Go extension)
import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "tools" / "container" / "build_offline.sh"


@pytest.fixture(scope="module")
def commands() -> list:
    return list(dockerfile.parse_file(str(ROOT / "Containerfile")))


def _section(name: str) -> str:
    """The lines of one ``[table]`` of pyproject.toml (tomllib is Python 3.11+; we run on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    return text.split(f"[{name}]\n", 1)[1].split("\n[", 1)[0]


def _args(commands) -> dict[str, str]:
    """Every ARG's default, by name."""
    found = {}
    for c in commands:
        if c.cmd == "ARG":
            for value in c.value:
                name, _, default = value.partition("=")
                found[name] = default.strip('"')
    return found


def test_one_stage_whose_variant_is_chosen_by_build_arguments(commands):
    """CPU and CUDA come from the same file: the base and torch's wheel index are ARGs,
    declared before FROM (so FROM can read BASE) or after it (so RUN can read them)."""
    kinds = [c.cmd for c in commands]
    assert kinds.count("FROM") == 1 and kinds[0] == "ARG"
    assert commands[kinds.index("FROM")].value == ("${BASE}",)
    args = _args(commands)
    assert args["BASE"].startswith("docker.io/library/debian:")
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(" ".join(c.value) for c in commands if c.cmd == "RUN")
    assert "--index-url $TORCH_INDEX torch==$TORCH_VERSION" in runs


def test_torch_is_the_readme_version_and_extras_exist(commands):
    readme = (ROOT / "README.md").read_text()
    pinned = re.search(r"pip install torch==([\d.]+)", readme).group(1)
    assert _args(commands)["TORCH_VERSION"] == pinned
    extras = _section("project.optional-dependencies")
    runs = [" ".join(c.value) for c in commands if c.cmd == "RUN"]
    installed = [m for r in runs for m in re.findall(r'pip install -e "\.\[([\w,]+)\]"', r)]
    assert installed, runs
    for name in installed[0].split(","):
        assert re.search(rf"^{name} = \[", extras, re.M), name


def test_every_copy_source_exists_and_the_package_is_complete(commands):
    """A renamed folder fails here, not in a build; every top-level package setuptools
    installs (pyproject's find.include) and the configs it reads at run time are copied."""
    copied = set()
    for c in commands:
        if c.cmd == "COPY":
            *sources, _ = c.value
            for source in sources:
                assert (ROOT / source).exists(), source
                copied.add(source)
    include = re.search(r"^include = \[(.*)\]", _section("tool.setuptools.packages.find"), re.M)
    wanted = {p.strip(' "*') for p in include.group(1).split(",")}
    assert wanted | {"configs", "pyproject.toml", "README.md"} <= copied


def test_runs_start_in_a_workspace_that_holds_their_outputs(commands):
    workdirs = [c.value[0] for c in commands if c.cmd == "WORKDIR"]
    assert workdirs[-1] == "/workspace"
    env = " ".join(" ".join(c.value) for c in commands if c.cmd == "ENV")
    assert "MESHTRON_CACHE /workspace/" in env or "MESHTRON_CACHE=/workspace/" in env
    cmd = next(c for c in commands if c.cmd == "CMD")
    assert cmd.json and cmd.value == ("python", "-m", "engine.pretrain")


def test_build_context_leaves_out_what_git_leaves_out():
    """Checkpoints and run folders in the checkout must not be sent to the builder (nor
    baked into the image); .dockerignore names every folder .gitignore does."""

    def names(path: str) -> set[str]:
        lines = (ROOT / path).read_text().splitlines()
        entries = [ln.removeprefix("**/").strip("/") for ln in lines]
        return {e for e in entries if e and e[0] not in "#*"}  # not comments, not *.pyc

    missing = names(".gitignore") - names(".dockerignore")
    assert not missing, f".dockerignore lacks {sorted(missing)}"


def test_every_optional_pip_argument_has_an_empty_default(commands):
    """An ARG with no default that a build does not pass makes podman and buildah warn; the
    PIP_* ones are optional, so each is declared ``ARG NAME=`` (pip ignores the empty value)."""
    declared = [v for c in commands if c.cmd == "ARG" for v in c.value]
    pip = [v for v in declared if v.startswith("PIP_")]
    assert pip, declared
    assert [v for v in pip if "=" not in v] == []


def test_offline_build_script_parses_and_passes_only_declared_arguments(commands):
    """`make image` runs the script; every --build-arg it passes is an ARG of the
    Containerfile (a renamed ARG would be dropped with only a warning), and it passes the
    ones the offline build relies on: a local base and pip reading only the wheel folder."""
    assert BUILD_SCRIPT.is_file() and BUILD_SCRIPT.stat().st_mode & 0o111, BUILD_SCRIPT
    bash = shutil.which("bash")
    assert bash, "bash is needed to check the script"
    parsed = subprocess.run([bash, "-n", str(BUILD_SCRIPT)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    passed = set(re.findall(r"--build-arg\s+([A-Z_][A-Z0-9_]*)=", BUILD_SCRIPT.read_text()))
    assert {"BASE", "PIP_FIND_LINKS", "PIP_NO_INDEX"} <= passed, passed
    assert passed <= set(_args(commands)), passed - set(_args(commands))
    makefile = (ROOT / "Makefile").read_text()
    target = re.search(r"^image:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert target and "tools/container/build_offline.sh" in target.group(1), makefile
