#!/usr/bin/env bash
# Builds the ringlimit:local image FROM scratch out of the locally built release binary
# and exactly the shared libraries it links (as `ldd` lists them, dynamic loader
# included). Needs no image registry: nothing is pulled.
#
#   docker/build-image.sh                   # cargo build --release --locked, then docker build
#   RINGLIMIT_BIN=/path/to/ringlimit docker/build-image.sh   # use that binary, skip cargo
#   RINGLIMIT_IMAGE=ringlimit:dev docker/build-image.sh      # other tag (default ringlimit:local)
#
# Works from any directory. With a registry, docker/Dockerfile.registry builds the
# image from source instead (see docker/README.md).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
image="${RINGLIMIT_IMAGE:-ringlimit:local}"

log() { printf 'build-image: %s\n' "$*" >&2; }
die() { printf 'build-image: error: %s\n' "$*" >&2; exit 1; }

command -v docker >/dev/null 2>&1 || die "docker not found"
command -v ldd >/dev/null 2>&1 || die "ldd not found (needed to find the binary's shared libraries)"

if [[ -n "${RINGLIMIT_BIN:-}" ]]; then
    bin="$(cd "$(dirname "$RINGLIMIT_BIN")" && pwd)/$(basename "$RINGLIMIT_BIN")"
    [[ -x "$bin" ]] || die "RINGLIMIT_BIN=$RINGLIMIT_BIN is not an executable file"
    log "using RINGLIMIT_BIN=$bin (no cargo build)"
else
    command -v cargo >/dev/null 2>&1 || die "cargo not found (or set RINGLIMIT_BIN to a built binary)"
    log "cargo build --release --locked (in $repo)"
    (cd "$repo" && cargo build --release --locked)
    target_dir="${CARGO_TARGET_DIR:-$repo/target}"
    [[ "$target_dir" = /* ]] || target_dir="$repo/$target_dir"
    bin="$target_dir/release/ringlimit"
    [[ -x "$bin" ]] || die "no binary at $bin after cargo build"
fi

ctx="$(mktemp -d "${TMPDIR:-/tmp}/ringlimit-image.XXXXXX")"
trap 'rm -rf "$ctx"' EXIT
rootfs="$ctx/rootfs"
mkdir -p "$rootfs/etc" "$rootfs/tmp"
chmod 1777 "$rootfs/tmp"

# Without debug info: the release profile keeps line tables (debug = 1) for profiling on
# the host, which made the image 84 MB; the image only needs the code.
if command -v strip >/dev/null 2>&1; then
    strip --strip-debug -o "$rootfs/ringlimit" "$bin"
else
    log "strip not found: the image keeps the binary's debug info"
    cp "$bin" "$rootfs/ringlimit"
fi
chmod 0755 "$rootfs/ringlimit"

# Every library ldd resolves, at the path the loader looks for it (symlinks dereferenced:
# on merged-/usr systems /lib64/ld-linux-x86-64.so.2 is a link into /usr/lib).
#   libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)   -> field 3
#   /lib64/ld-linux-x86-64.so.2 (0x...)                     -> field 1
# "linux-vdso.so.1 (0x...)" is provided by the kernel and has no file.
ldd_out="$(ldd "$bin" 2>&1)" || die "ldd failed on $bin: $ldd_out"
if grep -q 'not a dynamic executable\|statically linked' <<<"$ldd_out"; then
    log "binary is statically linked: no libraries to copy"
    ldd_out=""
fi
if grep -q '=> not found' <<<"$ldd_out"; then
    die "unresolved libraries: $(grep '=> not found' <<<"$ldd_out" | tr '\n' ' ')"
fi
libs=()
while read -r a b c _; do
    if [[ "$b" == "=>" && "$c" == /* ]]; then
        libs+=("$c")
    elif [[ "$a" == /* ]]; then
        libs+=("$a")
    fi
done <<<"$ldd_out"
loader_found=0
for lib in "${libs[@]}"; do
    [[ -e "$lib" ]] || die "ldd names $lib but it does not exist"
    mkdir -p "$rootfs$(dirname "$lib")"
    cp -L "$lib" "$rootfs$lib"
    log "  + $lib"
    [[ "$lib" == */ld-linux* || "$lib" == */ld-musl* ]] && loader_found=1
done
if [[ -n "$ldd_out" && "$loader_found" -ne 1 ]]; then
    die "ldd listed no dynamic loader for $bin; the image would not start"
fi

# Minimal /etc: name resolution from /etc/hosts then DNS (docker mounts /etc/hosts and
# /etc/resolv.conf at run time; glibc >= 2.34 has the files/dns NSS modules built in),
# and a passwd/group entry for the unprivileged user the image runs as.
printf 'hosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
printf 'root:x:0:0:root:/:/ringlimit\nnobody:x:65534:65534:nobody:/:/ringlimit\n' >"$rootfs/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$rootfs/etc/group"

cp "$here/Dockerfile" "$ctx/Dockerfile"

version="$("$bin" --version 2>/dev/null | awk '{print $2}')" || version=""
revision="$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || true)"

# Without the buildx plugin, recent docker CLIs fall back to the legacy builder anyway;
# say so up front instead of failing when DOCKER_BUILDKIT=1 is set in the environment.
if ! docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0
fi

log "docker build -t $image (context $ctx, $(du -sh "$ctx" | cut -f1))"
docker build \
    --build-arg "RINGLIMIT_VERSION=${version:-unknown}" \
    --build-arg "RINGLIMIT_REVISION=${revision:-unknown}" \
    -t "$image" "$ctx"
log "built $image (ringlimit ${version:-?}, ${revision:-no git revision})"
