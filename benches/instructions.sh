#!/usr/bin/env bash
# Instructions per call of pg-semaphore's hot SQL, counted by callgrind in
# a single-user backend (`postgres --single`): the same to 0.01% from run to
# run (the same seed, the same state), where the bench's throughput moves
# 10-40% between runs on a small machine. Use it to tell whether a change
# to a function makes the server do less work; use the bench (`cargo bench
# --bench bench`) for what that does to throughput.
#
#   benches/instructions.sh [CALLS]     # CALLS per workload, 3000 by default
#
# Builds a throwaway cluster (fsync off) from migrations/, brings every key
# to a steady state (20 admissions each), runs each workload's CALLS
# statements (each its own transaction, on 1,000 keys at
# random, as workload 6's spread keys) in a fresh backend under callgrind,
# and prints each one's instructions per call above the same backend's
# `SELECT 1`, and ÷ the bare `UPDATE` of workload 6's baseline. The first
# call of each function in a backend also compiles it: with 3,000 calls
# that adds well under 1%.
#
# Needs the PostgreSQL server binaries (the newest /usr/lib/postgresql/*/bin,
# or PGSEMAPHORE_PG_BIN) and valgrind. Run as root, the servers run as the
# `postgres` user. About 3.5 minutes in all on a 2-core machine.
set -euo pipefail

calls=${1:-3000}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${PGSEMAPHORE_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}
[ -x "$bin/postgres" ] || bin=$(dirname "$(command -v postgres || echo /nonexistent/postgres)")
[ -x "$bin/postgres" ] || { echo "no PostgreSQL server binaries: set PGSEMAPHORE_PG_BIN" >&2; exit 1; }
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 1; }

dir=$(mktemp -d /tmp/pg-semaphore-instructions.XXXXXX)
as=()
if [ "$(id -u)" = 0 ]; then
    chown postgres: "$dir"
    as=(runuser -u postgres --)
fi
port=$((20000 + RANDOM % 20000))
cleanup() {
    "${as[@]}" "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap cleanup EXIT

"${as[@]}" "$bin/initdb" -D "$dir/data" -A trust -U postgres --no-sync >/dev/null
cat >>"$dir/data/postgresql.conf" <<EOF
port = $port
listen_addresses = ''
unix_socket_directories = '$dir'
fsync = off
full_page_writes = off
synchronous_commit = off
EOF
"${as[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w start >/dev/null
psql=("$bin/psql" -X -q -v ON_ERROR_STOP=1 -h "$dir" -p "$port" -U postgres -d postgres)
for f in "$here"/migrations/*.sql; do
    "${psql[@]}" -f "$f" >/dev/null
done
"${psql[@]}" -c "CREATE TABLE rate_counters (key text PRIMARY KEY, n bigint NOT NULL DEFAULT 0);
                 INSERT INTO rate_counters (key) SELECT 'user-' || i FROM generate_series(0, 999) AS i;"
# Steady state first: every key's limits stored and 20 admissions in its
# ledger (trimmed every 16th, as in a long run), every counter updated 20
# times; then the statistics a running server's autovacuum would have.
for round in $(seq 20); do
    "${psql[@]}" -c "UPDATE rate_counters SET n = n + 1;
        SELECT count(*) FROM generate_series(0, 999) AS k,
            LATERAL pgsemaphore.token_bucket('bucket', 'user-' || k, 1000, 1000, 1),
            LATERAL pgsemaphore.fixed_window('fixed', 'user-' || k, 1000, interval '1 s', 1),
            LATERAL pgsemaphore.sliding_window('sliding', 'user-' || k, 1000, interval '1 s', 1);" >/dev/null
done
"${psql[@]}" -c "VACUUM ANALYZE"
"${as[@]}" "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null

# name|statement, with K for a random key.
workloads=(
    "SELECT 1|SELECT 1;"
    "bare UPDATE (baseline)|UPDATE rate_counters SET n = n + 1 WHERE key = 'K';"
    "token_bucket|SELECT * FROM pgsemaphore.token_bucket('bucket', 'K', 1000, 1000, 1);"
    "fixed_window|SELECT * FROM pgsemaphore.fixed_window('fixed', 'K', 1000, interval '1 s', 1);"
    "sliding_window|SELECT * FROM pgsemaphore.sliding_window('sliding', 'K', 1000, interval '1 s', 1);"
    "check_limits, 3 limits|SELECT * FROM pgsemaphore.check_limits(ARRAY['token_bucket', 'fixed_window', 'sliding_window'], ARRAY['bucket', 'fixed', 'sliding'], ARRAY['K', 'K', 'K'], ARRAY[1000, NULL, NULL]::float8[], ARRAY[1000, NULL, NULL]::float8[], ARRAY[NULL, 1000, 1000]::bigint[], ARRAY[NULL, '1 s', '1 s']::interval[], 1);"
)

# Instructions of a backend running $2 $calls times.
count() {
    local input="$dir/$1.sql"
    awk -v n="$calls" -v s="$2" 'BEGIN { srand(35); for (i = 0; i < n; i++) { t = s; gsub(/K/, "user-" int(rand() * 1000), t); print t } }' >"$input"
    chmod 644 "$input"
    "${as[@]}" valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        "$bin/postgres" --single -D "$dir/data" postgres <"$input" 2>&1 >/dev/null |
        sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}

printf '%s calls per workload, instructions per call above SELECT 1 (callgrind)\n\n' "$calls"
printf '| workload | instructions per call | ÷ bare UPDATE |\n|---|--:|--:|\n'
base=""
update=""
i=0
for w in "${workloads[@]}"; do
    name=${w%%|*}
    total=$(count "w$i" "${w#*|}")
    i=$((i + 1))
    if [ -z "$base" ]; then
        base=$total
        continue
    fi
    per=$(((total - base) / calls))
    [ -n "$update" ] || update=$per
    printf '| %s | %s | %s |\n' "$name" "$per" "$(awk -v a="$per" -v b="$update" 'BEGIN { printf "%.2fx", a / b }')"
done
