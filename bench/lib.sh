# Shell helpers the lease benches share (sourced, not run).

cpu_ticks() { # utime + stime of the given pids, in clock ticks
    local total=0
    for pid in "$@"; do
        set -- $(cut -d' ' -f14,15 "/proc/$pid/stat")
        total=$((total + $1 + $2))
    done
    echo "$total"
}

# Sum of metric $2's samples on the ops port $1, optionally only lines matching the regex
# $3. The value is the last field: a label value may hold a space (route="GET /x").
metric() {
    curl -s "127.0.0.1:$1/metrics" | { grep -E "${3:-.}" || true; } |
        awk -v m="$2" '$1 == m || index($1, m "{") == 1 { s += $NF } END { printf "%d", s }'
}
