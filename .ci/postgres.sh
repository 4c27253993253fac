# Sourced by .ci/run: a throwaway PostgreSQL server on loopback for the ledger's tests.
#
# Installs Debian's `postgresql` package when it is absent (CI runs as root, with network
# only to the package registries), starts a server of its own in a temporary directory
# (trust authentication, 127.0.0.1 only, a free port), creates a database, and exports
# SDCREPLAY_TEST_POSTGRES=postgresql://... for the tests. The server is stopped when the
# calling shell exits. Any failure stops CI with a message: the PostgreSQL tests must run.

ci_pg_fail() {
    echo "ci: $*" >&2
    exit 1
}

if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    echo "ci: installing PostgreSQL (Debian's postgresql package)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || ci_pg_fail "apt-get update failed: cannot install PostgreSQL"
    apt-get install -y -qq postgresql >/dev/null ||
        ci_pg_fail "apt-get install postgresql failed: the ledger's PostgreSQL tests cannot run"
fi
CI_PG_BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
CI_PG_DIR=$(mktemp -d /tmp/sdcreplay-ci-postgres.XXXXXX)
CI_PG_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || ci_pg_fail "the postgres user is missing (is the package installed?)"
    chown postgres: "$CI_PG_DIR"
    CI_PG_AS=(runuser -u postgres --)  # initdb and the server refuse to run as root
else
    CI_PG_AS=()
fi
"${CI_PG_AS[@]}" "$CI_PG_BIN/initdb" -D "$CI_PG_DIR/data" -U postgres --auth=trust -E UTF8 \
    >"$CI_PG_DIR/initdb.log" 2>&1 || { cat "$CI_PG_DIR/initdb.log" >&2; ci_pg_fail "initdb failed"; }
"${CI_PG_AS[@]}" "$CI_PG_BIN/pg_ctl" -D "$CI_PG_DIR/data" -l "$CI_PG_DIR/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $CI_PG_PORT -k $CI_PG_DIR" start >/dev/null ||
    { cat "$CI_PG_DIR/server.log" >&2; ci_pg_fail "the PostgreSQL server did not start"; }
ci_pg_stop() {
    "${CI_PG_AS[@]}" "$CI_PG_BIN/pg_ctl" -D "$CI_PG_DIR/data" -m fast stop >/dev/null 2>&1 || true
    rm -rf "$CI_PG_DIR"
}
trap ci_pg_stop EXIT
"${CI_PG_AS[@]}" "$CI_PG_BIN/psql" -h 127.0.0.1 -p "$CI_PG_PORT" -U postgres -q \
    -c "CREATE DATABASE sdcreplay_test" || ci_pg_fail "cannot create the test database"
export SDCREPLAY_TEST_POSTGRES="postgresql://postgres@127.0.0.1:$CI_PG_PORT/sdcreplay_test"
echo "ci: PostgreSQL $("$CI_PG_BIN/postgres" --version | awk '{print $3}') at $SDCREPLAY_TEST_POSTGRES" >&2
