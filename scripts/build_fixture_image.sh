#!/usr/bin/env bash
# Build the test fixture image: a small OCI image in SWE-bench's layout, made only from Debian
# packages (mmdebstrap, bookworm minbase) and PyPI files.  It stands in for a published SWE-bench
# instance image (`swebench/sweb.eval.x86_64.psf_1776_requests-<n>`):
#   * the repository psf/requests at version 2.27 (its 2.27.1 sdist from PyPI, committed as one git
#     commit) at /testbed, the image's working directory;
#   * an env named `testbed` that activates exactly as swebench's eval scripts activate it:
#     `source /opt/miniconda3/bin/activate && conda activate testbed`.  /opt/miniconda3/bin/activate
#     is a small stand-in for conda's (no conda package is in Debian): it defines a `conda` shell
#     function whose `activate NAME` sources the venv /opt/miniconda3/envs/NAME (python3 -m venv),
#     which holds pytest, the test dependencies of requests' own test suite and requests itself
#     (editable), installed offline from wheels downloaded here.
#
# Usage: build_fixture_image.sh OUT_LAYOUT [TAG]   (OUT_LAYOUT: an OCI image layout folder, created;
# TAG default `fixture`).  Needs root (mmdebstrap's root mode chroots), mmdebstrap, umoci, git and
# a pip; reaches deb.debian.org and PyPI.  Takes a few minutes; callers cache the result keyed by
# this file's hash (tests/support/images.py).
set -euo pipefail
out=${1:?usage: build_fixture_image.sh OUT_LAYOUT [TAG]}
tag=${2:-fixture}
suite=bookworm
pip=${PIP:-pip3}
work=$(mktemp -d "${TMPDIR:-/tmp}/fixture-image.XXXXXX")
trap 'rm -rf "$work"' EXIT

# 1. The repository and the env's wheels (CPython 3.11 = bookworm's python3).
"$pip" download -q --no-binary :all: --no-deps -d "$work/sdist" requests==2.27.1
"$pip" download -q --only-binary :all: --python-version 3.11 --implementation cp --abi cp311 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$work/wheels" \
  pytest==7.4.4 pytest-mock==3.12.0 trustme==1.1.0 PySocks==1.7.1 \
  urllib3==1.26.18 idna==3.6 charset-normalizer==2.0.12 certifi==2024.2.2 setuptools==69.0.3 wheel==0.42.0

cat > "$work/activate" <<'EOF'
# Stand-in for /opt/miniconda3/bin/activate (Turnstile's test fixture image; no conda inside):
# defines `conda activate NAME` / `conda deactivate` over the venvs in /opt/miniconda3/envs/.
# `source activate NAME` activates NAME at once, as conda's own script does.
conda() {
  case "${1:-}" in
    activate)
      if [ ! -f "/opt/miniconda3/envs/${2:-}/bin/activate" ]; then
        echo "conda: no env named '${2:-}' in /opt/miniconda3/envs" >&2; return 1
      fi
      . "/opt/miniconda3/envs/$2/bin/activate"
      export CONDA_DEFAULT_ENV="$2" CONDA_PREFIX="/opt/miniconda3/envs/$2" ;;
    deactivate) deactivate 2>/dev/null; unset CONDA_DEFAULT_ENV CONDA_PREFIX ;;
    *) echo "conda (fixture stand-in): only 'activate NAME' and 'deactivate'" >&2; return 1 ;;
  esac
}
if [ -n "${1:-}" ]; then conda activate "$1"; fi
EOF

cat > "$work/customize.sh" <<'EOF'
#!/bin/sh
# mmdebstrap customize hook: $1 is the new root.
set -eu
root=$1
mkdir -p "$root/testbed" "$root/opt/miniconda3/bin" "$root/opt/miniconda3/envs" "$root/tmp/wheels"
tar -xzf "$WORK"/sdist/requests-2.27.1.tar.gz -C "$root/testbed" --strip-components=1
cp "$WORK"/wheels/* "$root/tmp/wheels/"
install -m 0644 "$WORK/activate" "$root/opt/miniconda3/bin/activate"
chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 /bin/sh -c '
  set -eu
  cd /testbed
  rm -rf requests.egg-info  # a git checkout has none; the editable install below writes its own
  # Fixed dates: the same tree always gives the same commit id.
  export GIT_AUTHOR_DATE=2022-01-05T12:00:00Z GIT_COMMITTER_DATE=2022-01-05T12:00:00Z
  git init -q -b main
  git -c user.name=fixture -c user.email=fixture@localhost add -A
  git -c user.name=fixture -c user.email=fixture@localhost commit -q -m "requests 2.27.1 (PyPI sdist)"
  python3 -m venv /opt/miniconda3/envs/testbed
  /opt/miniconda3/envs/testbed/bin/pip install -q --no-index --find-links /tmp/wheels --disable-pip-version-check \
    pytest pytest-mock trustme PySocks setuptools wheel "urllib3<1.27" "idna<4" "charset-normalizer~=2.0.0" certifi
  /opt/miniconda3/envs/testbed/bin/pip install -q --no-index --find-links /tmp/wheels --disable-pip-version-check \
    --no-build-isolation --no-deps -e /testbed
  git config --system --add safe.directory /testbed
'
rm -rf "$root/tmp/wheels" "$root"/root/.cache "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
EOF
chmod +x "$work/customize.sh"

# 2. The root filesystem (no /dev entries: a container runtime provides /dev).
WORK=$work mmdebstrap --quiet --mode=root --variant=minbase --format=tar \
  --include=python3,python3-venv,git,ca-certificates,procps \
  --skip=output/dev \
  --customize-hook="$work/customize.sh \"\$1\"" \
  "$suite" "$work/rootfs.tar"

# 3. One layer, the image config (Env, WorkingDir, Cmd) as in SWE-bench's images.
rm -rf "$out"
umoci init --layout "$out"
umoci new --image "$out:$tag"
umoci raw add-layer --image "$out:$tag" "$work/rootfs.tar"
umoci config --image "$out:$tag" --config.workingdir /testbed \
  --config.env "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" --config.env "LANG=C.UTF-8" \
  --config.cmd /bin/bash --author turnstile-fixture
umoci gc --layout "$out"
echo "fixture image: $out:$tag"
