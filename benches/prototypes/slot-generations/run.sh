#!/usr/bin/env bash
# A prototype, not the crate: can a lease semaphore keep its speed while a
# long query holds back VACUUM? Three slot-table designs, each claim +
# release as plain SQL under pgbench (4 clients, capacity 64), each first
# undisturbed, then while another session of the same database runs one
# long `SELECT pg_sleep(..)`. Prints each design's claim + release cycles/s
# per 30 s interval and its ratio to its own last undisturbed interval.
#
#   partial-index        today's shape: live claims found and counted through
#                        the partial unique index on (semaphore, slot)
#   generations          a slot's state is its newest row: claims look up
#                        each slot's newest row through (semaphore, slot,
#                        gen) descending, LIMIT 1; no partial index
#   generations-with-partial-index
#                        the same, with the partial unique index kept as a
#                        constraint (every insert checks it)
#
# Usage: benches/prototypes/slot-generations/run.sh [PRESSURE_SECONDS] [DESIGN...]
# (default 300 s and all three). Needs pgbench and a PostgreSQL at
# PGHOST/PGPORT/PGUSER (default 127.0.0.1:5432, postgres); creates and
# drops the database pgsemaphore_proto. Commits with synchronous_commit=off.
set -euo pipefail
cd "$(dirname "$0")"
export PGHOST=${PGHOST:-127.0.0.1} PGPORT=${PGPORT:-5432} PGUSER=${PGUSER:-postgres}
PRESSURE=${1:-300}
shift || true
DESIGNS=("$@")
[ ${#DESIGNS[@]} -gt 0 ] || DESIGNS=(partial-index generations generations-with-partial-index)
BASELINE=90   # three 30 s intervals; the last one is the baseline
DB=pgsemaphore_proto
OUT=$(mktemp -d)
trap 'psql -qAt -d postgres -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '"'$DB'"' AND pid <> pg_backend_pid()" >/dev/null 2>&1 || true; rm -rf "$OUT"' EXIT

# The pgbench script of a design: generations-with-partial-index is
# generations.sql on the g2_ tables (whose schema adds the partial index).
script() {
    if [ "$1" = generations-with-partial-index ]; then
        sed 's/g_slots/g2_slots/g; s/g_sem/g2_sem/g' generations.sql >"$OUT/$1.sql"
        echo "$OUT/$1.sql"
    else
        echo "$1.sql"
    fi
}

psql -q -d postgres -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB" 2>/dev/null
for design in "${DESIGNS[@]}"; do
    psql -q -d $DB -f schema.sql 2>/dev/null
    psql -q -d $DB -c "VACUUM ANALYZE"
    total=$((BASELINE + PRESSURE))
    PGOPTIONS='-c synchronous_commit=off' \
        pgbench -n -c 4 -j 2 -T $total -P 30 -f "$(script "$design")" $DB >"$OUT/$design" 2>&1 &
    bench=$!
    sleep $BASELINE
    psql -qAt -d $DB -c "SELECT pg_sleep($total)" >/dev/null 2>&1 &
    holder=$!
    wait $bench
    held=$(psql -qAt -d $DB -c "SELECT coalesce(max(age(backend_xmin)), 0) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'")
    psql -qAt -d $DB -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'" >/dev/null
    wait $holder 2>/dev/null || true
    echo "$held" >"$OUT/$design.held"
done

echo "| design | undisturbed cycles/s (3 intervals) | ratio per 30 s interval under the held query | horizon held at the end (xids) |"
echo "|---|---|---|---:|"
for design in "${DESIGNS[@]}"; do
    awk -v design="$design" -v held="$(cat "$OUT/$design.held")" -v base_n=$((BASELINE / 30)) '
        /^progress:/ { n++; tps[n] = $4 }
        END {
            base = tps[base_n]; undisturbed = ""; ratios = ""
            for (i = 1; i <= base_n; i++) undisturbed = undisturbed sprintf("%s%.0f", i > 1 ? " " : "", tps[i])
            for (i = base_n + 1; i <= n; i++) ratios = ratios sprintf("%s%.2f", i > base_n + 1 ? " " : "", tps[i] / base)
            printf "| %s | %s | %s | %s |\n", design, undisturbed, ratios, held
        }' "$OUT/$design"
done
