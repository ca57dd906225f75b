#!/usr/bin/env bash
# A minimal Debian 13 "trixie" root with CPython 3.13 and numpy, for the Python-frames tests of
# 3.13 (tests/test_python_stacks_313.py): the tests run tests/progs/py_calltree.py under that
# root's /usr/bin/python3.13 with `chroot --userspec`, and the collector reads its interpreter
# through /proc/PID/root. Called by etc/dev/setup.sh (step 8), as root, on Debian 12 or 13.
#
# Idempotent: a root whose stamp names the same packages is kept as it is. A root is built into a
# temporary directory beside the final one and renamed at the end, so a half-made root is never
# used; a leftover temporary directory (an interrupted run) is removed first, after unmounting
# anything mmdebstrap left mounted in it.
#
# Environment: GPUPROF_TRIXIE_ROOT (default /var/lib/gpuprof-test/trixie),
#              GPUPROF_TRIXIE_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

ROOT="${GPUPROF_TRIXIE_ROOT:-/var/lib/gpuprof-test/trixie}"
MIRROR="${GPUPROF_TRIXIE_MIRROR:-http://deb.debian.org/debian}"
# Essential packages only (no apt, no init), plus the interpreter and numpy with its BLAS.
INCLUDE="python3.13,python3-numpy"
STAMP_NAME=.gpuprof-root-complete
STAMP_TEXT="trixie essential+$INCLUDE"

log() { echo "setup: $*"; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (the root is root-owned, mmdebstrap runs as root)"

if [ -f "$ROOT/$STAMP_NAME" ] && [ "$(cat "$ROOT/$STAMP_NAME")" = "$STAMP_TEXT" ] \
    && [ -x "$ROOT/usr/bin/python3.13" ]; then
    log "Debian 13 root with python3.13 present ($ROOT)"
    exit 0
fi
command -v mmdebstrap >/dev/null || die "mmdebstrap missing (apt-get install mmdebstrap)"

PARENT="$(dirname "$ROOT")"
NAME="$(basename "$ROOT")"
mkdir -p "$PARENT"
chown root:root "$PARENT"
chmod 0755 "$PARENT"

# Mount points left inside a directory (deepest first), then the directory itself.
remove_tree() {  # DIR
    local dir="$1" mp
    while read -r mp; do
        umount "$mp" || umount -l "$mp" || die "cannot unmount $mp"
    done < <(awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/mounts | sort -r)
    rm -rf --one-file-system -- "$dir"
}

shopt -s nullglob
for old in "$PARENT/.$NAME".tmp.*; do
    log "removing the unfinished root $old"
    remove_tree "$old"
done
shopt -u nullglob

TMP="$(mktemp -d "$PARENT/.$NAME.tmp.XXXXXX")"
trap 'remove_tree "$TMP"' EXIT
log "building a Debian 13 root with $INCLUDE in $ROOT (mmdebstrap, about 50 MB to download)"
start=$SECONDS
# --variant=essential: Essential: yes packages only (dpkg, coreutils, dash, ...), the smallest
# root that still has a shell; --include adds the interpreter and numpy with their dependencies.
mmdebstrap --quiet --mode=root --variant=essential --include="$INCLUDE" \
    --aptopt='Acquire::Retries "3"' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    trixie "$TMP" "$MIRROR" >/dev/null
[ -x "$TMP/usr/bin/python3.13" ] || die "no /usr/bin/python3.13 in the new root"
chroot "$TMP" /usr/bin/python3.13 -c 'import numpy, sys; assert sys.version_info[:2] == (3, 13)' \
    || die "python3.13 or numpy does not run in the new root"
echo "$STAMP_TEXT" > "$TMP/$STAMP_NAME"
chmod 0755 "$TMP"
if [ -e "$ROOT" ]; then
    log "replacing the old root $ROOT"
    remove_tree "$ROOT"
fi
mv -T "$TMP" "$ROOT"
trap - EXIT
log "Debian 13 root ready at $ROOT ($((SECONDS - start)) s, $(du -sm --one-file-system "$ROOT" | cut -f1) MB)"
