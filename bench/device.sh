#!/usr/bin/env bash
# How a device figure is made: the GPU box gets an exact commit of this tree and the wheels it lacks, and the
# benchmark runs there as written in its result's `command`. Two steps, so that no result depends on a driver
# script that was never committed:
#
#   bench/device.sh pack [--no-wheels]     here (with network): .carry/src.tar.gz = `git archive HEAD`, its
#                                          commit and whether the tree was clean; .whl/ = the cp312 wheels the
#                                          box lacks, ray trimmed to what the learner imports (the whole
#                                          wheel is over the 64 MiB a call carries)
#   bench/device.sh run -- CMD ...         there (no network): install .whl/ into /tmp/site, unpack the tree
#                                          into .carry/src, then run CMD inside it with STOA_COMMIT and
#                                          STOA_CLEAN set, so the result names the commit it measured
#
# The box is expected to have Python 3.12 and a CUDA torch (the device's image does); the wheels cover the
# rest of what bench/ and the learner import. Versions are this repository's venv's, pinned below.
set -euo pipefail
cd "$(dirname "$0")/.."

# pure-Python or cp312 wheels the box lacks (the venv's versions; megatron-core's newest that runs on 3.12)
WHEELS=(megatron-core==0.19.2 blake3==1.0.11 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
        pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        zstandard==0.25.0 bcrypt==5.0.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
        referencing==0.37.0 rpds-py==2026.9.1 rfc3339-validator==0.1.4 jsonpointer==3.12 attrs==26.1.0
        ml_dtypes==0.6.0 msgpack==1.2.4 psutil==7.2.2 PyYAML==6.0.4 bm25s==0.3.16)
RAY=ray==2.60.0
# ray's parts the learner never imports (the libraries on top of core ray; below, the dashboard's source maps and
# flame-graph viewer: the carry is 64 MiB with the tree)
RAY_DROP=(ray/jars ray/rllib ray/data ray/serve ray/tune ray/train ray/llm)

die() { echo "bench/device.sh: $*" >&2; exit 2; }

pack() {
  local wheels=1
  [[ "${1:-}" == "--no-wheels" ]] && wheels=0
  [[ $# -le 1 ]] || die "pack takes at most --no-wheels"
  mkdir -p .carry
  git archive --format=tar.gz -o .carry/src.tar.gz HEAD
  git rev-parse HEAD > .carry/COMMIT
  if [[ -z "$(git status --porcelain)" ]]; then echo 1 > .carry/CLEAN; else echo 0 > .carry/CLEAN; fi
  echo "packed $(cat .carry/COMMIT) (clean: $(cat .carry/CLEAN)) into .carry/src.tar.gz"
  ((wheels)) || return 0
  local pip=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
             --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
  mkdir -p .whl
  "${pip[@]}" -d .whl "${WHEELS[@]}"
  local tmp; tmp=$(mktemp -d)
  "${pip[@]}" -d "$tmp" "$RAY"
  mkdir "$tmp/unpacked"
  # `python -m zipfile -e` drops the modes: ray's gcs_server and raylet would not be executable there
  python3 -c 'import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for i in z.infolist():
    z.extract(i, sys.argv[2])
    if i.external_attr >> 16:
        os.chmod(os.path.join(sys.argv[2], i.filename), (i.external_attr >> 16) & 0o777)' "$tmp"/ray-*.whl "$tmp/unpacked"
  (cd "$tmp/unpacked" && rm -rf "${RAY_DROP[@]}" && find ray/dashboard -name '*.map' -delete && rm -rf ray/dashboard/client/build/speedscope-* && tar -cf - .) | xz -9e > .whl/ray-trimmed.tar.xz
  rm -rf "$tmp"
  du -sh .whl .carry
}

run() {
  [[ "${1:-}" == "--" ]] && shift
  [[ $# -ge 1 ]] || die "run needs the command to run: bench/device.sh run -- python -m bench.X ..."
  [[ -f .carry/src.tar.gz && -f .carry/COMMIT ]] || die "no .carry/src.tar.gz: run 'bench/device.sh pack' here first and carry .carry"
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  if [[ -f .whl/ray-trimmed.tar.xz ]]; then mkdir -p /tmp/site && tar -xJf .whl/ray-trimmed.tar.xz -C /tmp/site; fi
  rm -rf .carry/src && mkdir -p .carry/src && tar -xzf .carry/src.tar.gz -C .carry/src
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  export STOA_COMMIT; STOA_COMMIT=$(cat .carry/COMMIT)
  export STOA_CLEAN; STOA_CLEAN=$(cat .carry/CLEAN 2>/dev/null || echo 0)
  cd .carry/src
  exec "$@"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *) die "usage: bench/device.sh pack [--no-wheels] | bench/device.sh run -- COMMAND ..." ;;
esac
