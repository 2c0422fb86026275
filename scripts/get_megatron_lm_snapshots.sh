#!/usr/bin/env bash
# Extract the Megatron-LM training-package snapshots that the framework tests run
# (tests/test_frameworks_megatron_lm.py) from a shallow git clone of NVIDIA/Megatron-LM, one folder
# per release tag, each holding the files listed below exactly as they are at the tag, and its LICENSE.
#
#   scripts/get_megatron_lm_snapshots.sh [DEST]
#
# DEST defaults to ../shared/upstream/megatron-lm (beside the repository), where the tests look;
# elsewhere, point the tests at it with MEGATRON_FLOPS_MLM_SNAPSHOTS=DEST. A folder already there
# is replaced. MEGATRON_LM_GIT_URL overrides the repository (a mirror, a local clone).
# Needs git and network access to the repository; about 1 minute and 30 MB per tag.
set -euo pipefail

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$repo_root/../shared/upstream/megatron-lm}"
url="${MEGATRON_LM_GIT_URL:-https://github.com/NVIDIA/Megatron-LM.git}"

# tag, commit the tag names (checked), files and folders to copy.
snapshots=(
  "core_v0.16.1 55ac7082517c3878ae653c07c09c534b8aed49f6 pretrain_gpt.py gpt_builders.py model_provider.py megatron/training megatron/legacy megatron/post_training megatron/rl"
  "core_v0.14.0 23e00ed0963c35382dfe8a5a94fb3cda4d21e133 pretrain_gpt.py megatron/training megatron/legacy megatron/post_training megatron/inference"
  "core_v0.19.0 5be9626709af2722333bf54797c954c09edeada3 pretrain_gpt.py gpt_builders.py model_provider.py hybrid_builders.py mamba_builders.py megatron/training megatron/post_training megatron/rl megatron/inference megatron/elastification"
)

mkdir -p "$dest"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for entry in "${snapshots[@]}"; do
  read -r tag commit paths <<<"$entry"
  echo "$tag: cloning $url" >&2
  git -c advice.detachedHead=false clone --quiet --depth 1 --branch "$tag" "$url" "$work/$tag"
  got="$(git -C "$work/$tag" rev-parse HEAD)"
  if [ "$got" != "$commit" ]; then
    echo "$tag is commit $got in $url, expected $commit: not the release the tests were written against" >&2
    [ -n "${MEGATRON_LM_GIT_URL:-}" ] || exit 1
  fi
  rm -rf "${dest:?}/$tag.partial"
  mkdir -p "$dest/$tag.partial/megatron"
  for path in LICENSE $paths; do
    cp -R "$work/$tag/$path" "$dest/$tag.partial/$path"
  done
  rm -rf "${dest:?}/$tag"
  mv "$dest/$tag.partial" "$dest/$tag"
  rm -rf "${work:?}/$tag"
  echo "$tag: $dest/$tag" >&2
done
