#!/usr/bin/env bash
# Build meshtron's CPU image on a machine that reaches no container registry, only a Debian
# mirror and a Python package index (or a wheel folder): `make image`, or
#
#   tools/container/build_offline.sh [TAG]          # TAG defaults to meshtron:0.1.0-cpu
#
# 1. the base: `debootstrap --variant=minbase` of Debian (SUITE, from MIRROR) into a root
#    folder, `podman import`ed as BASE (skipped when BASE exists already);
# 2. the wheels: `pip download` of torch==TORCH_VERSION (the README's, CPU build), the
#    project's dependencies with the `hf` extra, and the build backend, into WORK/wheels, by
#    this machine's pip with its own configuration (its index, find-links, CA bundle), whose
#    Python must be the image's (PYTHON_VERSION; bookworm has 3.11);
# 3. the image: `podman build` of the Containerfile with --build-arg BASE=localhost/…,
#    the wheel folder mounted at /wheels (-v) and PIP_FIND_LINKS=/wheels PIP_NO_INDEX=1,
#    so pip inside the build reads nothing but that folder.
#
# Needs root (debootstrap, podman's storage), and `apt-get install debootstrap podman`.
# ISOLATION=chroot (the default) runs the build's RUN steps without an OCI runtime, for
# machines where crun cannot start containers (cgroups v1 or hybrid, no user namespaces);
# ISOLATION=oci uses the runtime. Everything it writes lies under WORK (build/ is ignored
# by git and by .dockerignore, so it is not sent as build context).
set -euo pipefail
cd "$(dirname "$0")/../.."

TAG=${1:-${TAG:-meshtron:0.1.0-cpu}}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
BASE=${BASE:-localhost/debian:$SUITE-minbase}
PYTHON_VERSION=${PYTHON_VERSION:-3.11}
ISOLATION=${ISOLATION:-chroot}
WORK=${WORK:-$PWD/build/container}
# The torch pin is the Containerfile's (the README's, checked by tests/test_container.py).
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' Containerfile)

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

for tool in debootstrap podman; do
    command -v "$tool" >/dev/null || { echo "needs $tool: apt-get install $tool" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "needs root (debootstrap, podman import)" >&2; exit 1; }
mkdir -p "$WORK"

if podman image exists "$BASE"; then
    step "base $BASE exists"
else
    step "base: debootstrap --variant=minbase $SUITE from $MIRROR"
    rootfs="$WORK/rootfs-$SUITE"
    rm -rf "$rootfs"
    debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR"
    # apt's lists and archives are not part of the base (the Containerfile updates first).
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -c . | podman import - "$BASE"
    rm -rf "$rootfs"
fi

step "wheels: torch==$TORCH_VERSION and the .[hf] dependencies for Python $PYTHON_VERSION"
# This Python resolves them, so it must be the image's: wheels for another version would
# not install there (and `pip download --python-version` takes no sdist, while
# hydra-core's antlr4-python3-runtime is one; the image's pip builds it from /wheels).
here=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$here" != "$PYTHON_VERSION" ]; then
    echo "python3 here is $here, the image's is $PYTHON_VERSION: run with a python3 of" \
        "that version first on PATH, or set PYTHON_VERSION to the base's" >&2
    exit 1
fi
wheels="$WORK/wheels"
mkdir -p "$wheels"
# setuptools and wheel: the build backend `pip install -e` needs (pyproject's build-system).
python3 -m pip download --dest "$wheels" --prefer-binary \
    "torch==$TORCH_VERSION" ".[hf]" "setuptools>=68" wheel
du -sh "$wheels"

step "image: podman build -t $TAG (isolation $ISOLATION)"
start=$(date +%s)
podman build --isolation "$ISOLATION" -t "$TAG" -f Containerfile \
    --build-arg BASE="$BASE" \
    --build-arg PIP_FIND_LINKS=/wheels \
    --build-arg PIP_NO_INDEX=1 \
    -v "$wheels:/wheels:ro" \
    .
echo "built $TAG in $(($(date +%s) - start)) s"
podman image ls "$TAG"
