#!/usr/bin/env bash
# gpt2numba on aarch64 under QEMU user emulation: `gpt2numba check` on a small random model, per dtype.
#
# Usage (as root, from anywhere):
#     profiling/qemu_aarch64.sh                    # build the arm64 root if needed, install, run the checks
#     ARM64_ROOT=/srv/arm64 CHECK_TIMEOUT=5400 profiling/qemu_aarch64.sh
#
# What it does:
#   1. apt-get installs qemu-user-static, binfmt-support and debootstrap if missing; mounts binfmt_misc
#      and registers the qemu-aarch64 handler (update-binfmts), checked in /proc/sys/fs/binfmt_misc.
#   2. Builds an arm64 Debian bookworm root (debootstrap --variant=minbase, with python3, venv, pip and
#      ca-certificates) in $ARM64_ROOT, unless one is there already whose python3 says "aarch64".
#   3. Mounts /proc, /dev and /sys into it for the run (unmounted on exit, whatever happens) and copies
#      /etc/resolv.conf and the host's CA bundle in.
#   4. Copies this checkout (its tracked and untracked-but-not-ignored files, as they are in the working
#      tree) to $ARM64_ROOT/opt/gpt2numba and pip-installs it into the venv /opt/venv of the root: the
#      core install, numpy, numba, scipy, safetensors, ... as PyPI's aarch64 wheels. Only the real PyPI
#      (https://pypi.org/simple) is used: the host's pip configuration (file:// indexes, constraints)
#      is not seen inside the root (PIP_CONFIG_FILE=/dev/null).
#   5. Prints uname -m, platform.machine(), numba's and llvmlite's versions, the threading layer, the CPU
#      name and features LLVM sees, what gpt2numba.cpu.dispatch chose and whether gpt2numba's pool is on
#      (it is x86-64 only: on aarch64 Numba's own threading layer runs the parallel regions); writes a
#      2-layer random checkpoint (n_embd 128, 2 heads of 64, GPT-2's vocabulary) to /var/tmp/gpt2numba-small
#      inside the root; then runs, each under `timeout $CHECK_TIMEOUT nice -n 10`,
#          gpt2numba check --model <it> --prompts 2 --prompt-len 16 --decode 4 --dtype D
#      for D in float32 bfloat16 int8 int4, and once more with --kv-dtype float16 (float32 weights).
#      Each run's whole output is printed, then "== <name>: exit <rc> in <s> s (<verdict>)", and a summary.
#
# Needs: root (apt, mount, chroot, binfmt_misc), network access to deb.debian.org (or $DEBIAN_MIRROR) and
# to pypi.org / files.pythonhosted.org. About 1 GB of disk for the root and the venv.
#
# How long (2 x86-64 cores): debootstrap ~5-15 min, pip install ~3-10 min (the first time only; later
# runs reuse the root and the venv), then Numba's compilation under emulation dominates each check:
# the first one compiles every kernel (tens of minutes); later ones reuse Numba's on-disk cache
# ($NUMBA_CACHE_DIR=/var/cache/gpt2numba-numba inside the root) for what they share.
#
# Exit status: 0 if every check passed, 1 if any failed or timed out, 2 on a setup error.
#
# If binfmt_misc cannot be mounted or the handler cannot be registered (an unprivileged container,
# or one whose kernel's binfmt_misc is not namespaced and is read-only), debootstrap's second stage
# and the chroot cannot run arm64 binaries, and no in-container fallback is reliable: the script stops
# and says so. The documented alternatives: register the handler on the host (Debian:
# `apt-get install qemu-user-static binfmt-support`; or `docker run --privileged --rm
# tonistiigi/binfmt --install arm64`), then rerun this script in the container; or run it on an
# arm64 machine, where no emulation is needed (it works unchanged there: the handler step is skipped).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${ARM64_ROOT:-/var/tmp/gpt2numba-arm64}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
CHECK_TIMEOUT=${CHECK_TIMEOUT:-3600}  # seconds per check run
MODEL=/var/tmp/gpt2numba-small        # inside the root
MARKER=.gpt2numba-arm64-root          # written into the root's top directory: ours to remove if broken

say() { printf '\n### %s [%s]\n' "$*" "$(date -u +%H:%M:%S)"; }
die() { printf 'qemu_aarch64.sh: %s\n' "$*" >&2; exit 2; }
now() { date +%s; }

[[ $(id -u) == 0 ]] || die "run as root (apt-get, mount, chroot)"
[[ -f $REPO/pyproject.toml && -d $REPO/gpt2numba ]] || die "$REPO is not a gpt2numba checkout"
NATIVE=0
[[ $(uname -m) == aarch64 ]] && NATIVE=1

# --- 1. QEMU and binfmt_misc ---------------------------------------------------------------------------
say "1. qemu-user-static, binfmt-support, debootstrap"
missing=()
for p in qemu-user-static binfmt-support debootstrap; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    echo "already installed"
fi

if ((NATIVE)); then
    echo "native aarch64 host: no emulation needed"
else
    if [[ ! -e /proc/sys/fs/binfmt_misc/register ]]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
            || die "cannot mount binfmt_misc (unprivileged container?): register qemu-aarch64 on the host, see the header"
    fi
    if ! grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null; then
        update-binfmts --enable qemu-aarch64 2>/dev/null || update-binfmts --import qemu-aarch64 || true
    fi
    grep -qx enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 2>/dev/null \
        || die "the qemu-aarch64 binfmt handler is not enabled and cannot be registered here: see the header"
    echo "binfmt handler /proc/sys/fs/binfmt_misc/qemu-aarch64:"
    sed 's/^/    /' /proc/sys/fs/binfmt_misc/qemu-aarch64
    /usr/bin/qemu-aarch64-static --version | head -1
fi

# --- mounts, undone at exit -----------------------------------------------------------------------------
MOUNTED=()
cleanup() {
    local i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        umount -R "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}" 2>/dev/null \
            || echo "qemu_aarch64.sh: could not unmount ${MOUNTED[i]}" >&2
    done
    MOUNTED=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mount_in() {  # mount_in <what> <args...>: mount into $ROOT/<what> unless something is mounted there already
    local at=$ROOT/$1
    shift
    mountpoint -q "$at" && return 0
    mkdir -p "$at"
    mount "$@" "$at"
    MOUNTED+=("$at")
}
mount_all() {
    mount_in proc -t proc proc
    mount_in sys --rbind /sys
    mount --make-rslave "$ROOT/sys"
    mount_in dev --rbind /dev
    mount --make-rslave "$ROOT/dev"
}
# a command inside the root, with a clean environment (nothing of the host's PIP_*, PYTHON*, NUMBA_* leaks in;
# its proxy settings do); PYTHONFAULTHANDLER: Python's stack when LLVM aborts the process
IN_ROOT=(chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    PIP_CONFIG_FILE=/dev/null PIP_CERT=/etc/ssl/certs/host-ca-certificates.crt
    PIP_INDEX_URL=https://pypi.org/simple PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
    NUMBA_CACHE_DIR=/var/cache/gpt2numba-numba PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1)
for v in HTTPS_PROXY https_proxy HTTP_PROXY http_proxy NO_PROXY no_proxy; do
    [[ -n ${!v:-} ]] && IN_ROOT+=("$v=${!v}")
done
in_root() { "${IN_ROOT[@]}" "$@"; }
# "$@"'s status, without bash's own notice of a child killed by a signal ("Aborted (core dumped)" and the whole
# command line): an LLVM error aborts the process, and Python's faulthandler has printed its stack already.
# "$@" must be a command, not a shell function (whose shell would print the notice where "$@" prints)
status_of() {
    ( "$@" 2>&3; exit $? ) 3>&2 2>/dev/null
}
signal_of() {  # " (SIGABRT)" for a status 134, else nothing
    (($1 > 128 && $1 < 160)) && printf ' (SIG%s)' "$(kill -l $(($1 - 128)))" || true
}
root_works() {
    [[ -x $ROOT/usr/bin/python3 ]] &&
        [[ $(chroot "$ROOT" /usr/bin/python3 -c 'import platform; print(platform.machine())' 2>/dev/null) == aarch64 ]]
}

# --- 2. the arm64 root -----------------------------------------------------------------------------------
say "2. arm64 Debian $SUITE root in $ROOT"
if root_works; then
    echo "exists and runs aarch64 Python: not rebuilt (remove $ROOT to rebuild)"
else
    if [[ -e $ROOT ]]; then
        if [[ -f $ROOT/$MARKER ]]; then
            echo "$ROOT is an unfinished or broken root of this script: removing it"
            for m in proc sys dev; do mountpoint -q "$ROOT/$m" && umount -R "$ROOT/$m"; done
            rm -rf --one-file-system "$ROOT"
        elif [[ -n $(ls -A "$ROOT") ]]; then
            die "$ROOT exists, is not empty and does not run aarch64 Python: move it away or set ARM64_ROOT"
        fi
    fi
    mkdir -p "$ROOT"
    touch "$ROOT/$MARKER"
    t=$(now)
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$SUITE" "$ROOT" "$MIRROR"
    echo "debootstrap took $(($(now) - t)) s"
    root_works || die "debootstrap finished but $ROOT's python3 does not run as aarch64"
fi

# --- 3. mounts and network -------------------------------------------------------------------------------
say "3. mounts and network"
mount_all
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
# the host's CA bundle (it may carry a proxy's CA that the root's ca-certificates lacks); pip uses this one
cp -L /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/host-ca-certificates.crt"
printf 'mounted: %s\n' "${MOUNTED[@]:-nothing new}"

# --- 4. the checkout into a venv -------------------------------------------------------------------------
say "4. pip install the checkout into /opt/venv (from $REPO)"
rm -rf --one-file-system "$ROOT/opt/gpt2numba"
mkdir -p "$ROOT/opt/gpt2numba"
# the working tree's files that git tracks or would track (no .git, no ignored build output or caches)
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [[ -f $f ]] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf -) | tar -x -C "$ROOT/opt/gpt2numba"
echo "copied $(find "$ROOT/opt/gpt2numba" -type f | wc -l) files ($(git -C "$REPO" rev-parse --short HEAD)$(
    [[ -n $(git -C "$REPO" status --porcelain) ]] && echo ", with the working tree's changes"))"
t=$(now)
[[ -x $ROOT/opt/venv/bin/python ]] || in_root /usr/bin/python3 -m venv /opt/venv
in_root pip install -q /opt/gpt2numba
# a rebuilt copy of the same version: install the package itself again, its dependencies as they are
in_root pip install -q --force-reinstall --no-deps /opt/gpt2numba
echo "pip install took $(($(now) - t)) s"
in_root pip list --format=freeze | grep -iE '^(numpy|numba|llvmlite|scipy|safetensors|ml.dtypes|tiktoken|gpt2numba)=' \
    | sed 's/^/    /'

# --- 5. what runs, then the checks -----------------------------------------------------------------------
say "5. the platform as the root sees it"
in_root uname -m
in_root python - <<'EOF'
import platform, os
import numba, llvmlite
from llvmlite import binding as ll
from numba import njit, prange, config
import numpy as np
print("platform.machine():", platform.machine(), "| python", platform.python_version())
print("numba", numba.__version__, "| llvmlite", llvmlite.__version__, "| LLVM", ".".join(map(str, ll.llvm_version_info)))
print("process triple:", ll.get_process_triple(), "| LLVM host CPU:", ll.get_host_cpu_name())
print("LLVM host CPU features:", ll.get_host_cpu_features().flatten() or "(none reported)")
print("numba.config.THREADING_LAYER:", config.THREADING_LAYER, "| NUMBA_NUM_THREADS:", config.NUMBA_NUM_THREADS,
      "| os.cpu_count():", os.cpu_count())
@njit(parallel=True)
def f(n):
    s = 0.0
    for i in prange(n):
        s += i
    return s
f(10)
print("threading layer after a parallel region:", numba.threading_layer())
EOF
echo "--- gpt2numba's choices on this CPU:"
rc=0
status_of "${IN_ROOT[@]}" python - <<'EOF' || rc=$?
import gpt2numba
from gpt2numba.cpu import dispatch, pool
print("dispatch.FEATURES:", dispatch.FEATURES, "(None: not x86)")
print("dispatch.CHOICES:", dispatch.CHOICES)
print("pool.enabled():", pool.enabled(), "(x86-64 Linux only; off: Numba's own threading layer runs the regions)")
EOF
((rc == 0)) || echo "(importing gpt2numba failed: exit $rc$(signal_of $rc); the checks below will fail the same way)"

say "writing the small checkpoint $MODEL (inside the root)"
rc=0
status_of "${IN_ROOT[@]}" python - "$MODEL" <<'EOF' || rc=$?
import sys
import gpt2numba as g
cfg = g.GPT2Config(n_layer=2, n_head=2, n_embd=128, n_positions=128, vocab_size=50257)
g.save_weights(g.random_weights(cfg, seed=0), sys.argv[1])
print("wrote", sys.argv[1], cfg)
EOF
((rc == 0)) || echo "(writing the checkpoint failed: exit $rc$(signal_of $rc); the checks below will say why)"

RUNS=(
    "float32|--dtype float32"
    "bfloat16|--dtype bfloat16"
    "int8|--dtype int8"
    "int4|--dtype int4"
    "float32, kv float16|--dtype float32 --kv-dtype float16"
)
SUMMARY=()
FAILED=0
for run in "${RUNS[@]}"; do
    name=${run%%|*}
    read -r -a flags <<<"${run#*|}"
    say "check: $name (timeout ${CHECK_TIMEOUT} s)"
    echo "\$ gpt2numba check --model $MODEL --prompts 2 --prompt-len 16 --decode 4 ${flags[*]}"
    t=$(now)
    rc=0
    status_of timeout --kill-after=60 "$CHECK_TIMEOUT" nice -n 10 "${IN_ROOT[@]}" \
        gpt2numba check --model "$MODEL" --prompts 2 --prompt-len 16 --decode 4 "${flags[@]}" 2>&1 || rc=$?
    s=$(($(now) - t))
    case $rc in
        0) verdict="pass" ;;
        124 | 137) verdict="TIMEOUT"; FAILED=1 ;;
        *) verdict="FAIL$(signal_of $rc)"; FAILED=1 ;;
    esac
    echo "== $name: exit $rc in $s s ($verdict)"
    SUMMARY+=("$(printf '%-22s exit %-3s %6s s  %s' "$name" "$rc" "$s" "$verdict")")
done

say "summary (uname -m in the root: $(chroot "$ROOT" uname -m))"
printf '  %s\n' "${SUMMARY[@]}"
exit "$FAILED"
