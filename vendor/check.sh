#!/usr/bin/env bash
# Checks that vendor/candle-core is candle-core 0.11.1 as published plus exactly the patches of
# vendor/patches, in order: the release (from cargo's registry) is copied, patched, and compared
# with the vendored copy: every file the copy keeps is the patched release's, and its Cargo.toml
# is the release's less its [[example]], [[test]] and [[bench]] targets (whose files are left out).
# With --test it also runs candle's own gradient tests on the patched release, the patches' tests
# among them.
set -euo pipefail
cd "$(dirname "$0")/.."
# The release: remat's own workspace depends on candle-core as published.
cargo fetch -q --manifest-path crates/remat/Cargo.toml
release=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-core-0.11.1 | head -1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$release" "$work/candle-core"
chmod -R u+w "$work/candle-core"
for p in vendor/patches/*.patch; do
  patch -s -p1 -d "$work/candle-core" < "$p" || { echo "$p does not apply to candle-core 0.11.1" >&2; exit 1; }
done
status=0
for f in $(cd vendor/candle-core && find . -type f ! -name Cargo.toml | sort); do
  cmp -s "vendor/candle-core/$f" "$work/candle-core/$f" || { echo "vendor/candle-core/${f#./} is not the patched release's" >&2; status=1; }
done
# And no file of the patched release's sources is missing from the copy.
diff -rq "$work/candle-core/src" vendor/candle-core/src >&2 || status=1
python3 - "$work/candle-core/Cargo.toml" vendor/candle-core/Cargo.toml <<'PY' || status=1
import re, sys
release, vendored = (open(p).read() for p in sys.argv[1:])
# The release's manifest without its example, test and bench targets (their lines; the blank lines stay).
trimmed = re.sub(r"\[\[(example|test|bench)\]\]\n(?:[^\n]+\n)*", "", release)
if trimmed != vendored:
    sys.exit("vendor/candle-core/Cargo.toml is not the release's less its example, test and bench targets")
PY
[ "$status" = 0 ] && echo "vendor/candle-core = candle-core 0.11.1 + $(ls vendor/patches/*.patch | wc -l) patches"
if [ "$status" = 0 ] && [ "${1:-}" = "--test" ]; then
  (cd "$work/candle-core" && CARGO_TARGET_DIR="$PWD/../target" cargo test -q --test grad_tests)
fi
exit "$status"
