#!/usr/bin/env bash
# The whole test suite, on a fresh machine: `bash scripts/test.sh`.
#
# Installs what the tests need and is missing (Debian/Ubuntu, as root or with
# passwordless sudo):
#   - the PostgreSQL server binaries (apt: postgresql), for the throwaway
#     server the tests start when DATABASE_URL is unset;
#   - PgBouncer (apt: pgbouncer), for tests/pgbouncer.rs;
#   - sqlx-cli 0.9 (cargo install), for tests/migrations.rs;
#   - Chromium (apt: chromium), for the browser tests;
#   - pg_isolation_regress (apt: postgresql-client), for tests/isolation.rs;
# then runs `cargo test --all-features` with PGSEMAPHORE_REQUIRE_TOOLS=1, so a
# test whose tool is missing fails instead of skipping. Arguments are passed
# on to cargo test (`bash scripts/test.sh --test pgbouncer`).
#
# DATABASE_URL is left as found. CI (.ci/run) runs exactly this.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

export DEBIAN_FRONTEND=noninteractive
# A fresh shell may not have cargo on PATH yet.
if ! command -v cargo >/dev/null && [[ -f "${CARGO_HOME:-$HOME/.cargo}/env" ]]; then
    # shellcheck source=/dev/null
    source "${CARGO_HOME:-$HOME/.cargo}/env"
fi

step() { printf '\n==> %s\n' "$*"; }

# Runs a command with its output hidden, showing it only if the command fails.
quietly() {
    local log status=0
    log=$(mktemp)
    "$@" >"$log" 2>&1 </dev/null || status=$?
    if ((status != 0)); then
        cat "$log" >&2
        echo "error: \`$*\` failed with status $status" >&2
    fi
    rm -f "$log"
    return "$status"
}

as_root() {
    if ((EUID == 0)); then
        "$@"
    else
        sudo -n "$@"
    fi
}

apt_updated=false
apt_install() {
    if ! $apt_updated; then
        quietly as_root apt-get update -q
        apt_updated=true
    fi
    quietly as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

step "Tools the tests need"
if compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
    echo "PostgreSQL server binaries: $(compgen -G '/usr/lib/postgresql/*/bin/initdb' | tr '\n' ' ')"
else
    echo "PostgreSQL server binaries: installing (apt-get install postgresql)"
    apt_install postgresql
fi

# tests/pgbouncer.rs runs PgBouncer (testkit/src/pgbouncer.rs) on a port of its
# own. The package's service, where an init system starts it, listens on 6432.
pgbouncer_bin=$(command -v pgbouncer || echo /usr/sbin/pgbouncer)
if [[ -x "$pgbouncer_bin" ]]; then
    echo "PgBouncer: $("$pgbouncer_bin" --version | head -n 1)"
else
    echo "PgBouncer: installing (apt-get install pgbouncer)"
    apt_install pgbouncer
fi

if sqlx --version 2>/dev/null | grep -Eq '^sqlx-cli 0\.9\.'; then
    echo "sqlx-cli: $(sqlx --version)"
else
    echo "sqlx-cli: installing 0.9.0 (cargo install, takes a few minutes)"
    quietly cargo install -q sqlx-cli --version 0.9.0 --locked \
        --no-default-features --features postgres,rustls,sqlx-toml
fi

# tests/isolation.rs runs PostgreSQL's isolation tester, which Debian ships
# in the client package, outside PATH.
if compgen -G '/usr/lib/postgresql/*/lib/pgxs/src/test/isolation/pg_isolation_regress' >/dev/null; then
    echo "pg_isolation_regress: $(compgen -G '/usr/lib/postgresql/*/lib/pgxs/src/test/isolation/pg_isolation_regress' | sort -V | tail -n 1)"
else
    echo "pg_isolation_regress: installing (apt-get install postgresql-client)"
    apt_install postgresql-client
fi

if [[ -x /usr/bin/chromium ]]; then
    echo "Chromium: $(/usr/bin/chromium --version 2>/dev/null | head -n 1)"
else
    echo "Chromium: installing (apt-get install chromium)"
    apt_install chromium
fi

if [[ -n "${DATABASE_URL:-}" ]]; then
    echo "DATABASE_URL is set: tests use that server"
else
    echo "DATABASE_URL is unset: tests start a throwaway PostgreSQL"
fi

export PGSEMAPHORE_REQUIRE_TOOLS=1
step "PGSEMAPHORE_REQUIRE_TOOLS=1 cargo test --all-features --no-fail-fast $*"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --all-features --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?

# The totals over every test binary's "test result:" line.
awk '
    /^test result: / {
        for (i = 1; i <= NF; i++) {
            n = $(i - 1) + 0
            if ($i ~ /^passed/) passed += n
            if ($i ~ /^failed/) failed += n
            if ($i ~ /^ignored/) ignored += n
        }
        binaries++
    }
    END {
        printf "\n==> Summary (%d test binaries and doc-test runs, %d ignored)\n", binaries, ignored
        printf "tests: %d passed, %d failed\n", passed, failed
    }
' "$log"
exit "$status"
