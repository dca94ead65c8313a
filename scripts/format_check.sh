#!/usr/bin/env bash
# C++ format check against .clang-format (clang-format as scripts/setup.sh pins
# it, in .venv): every C++ file of cc/ and ops/ must conform. scripts/test.sh
# runs it.
#   bash scripts/format_check.sh         fails naming each file that would change
#   bash scripts/format_check.sh --fix   formats those files in place
set -euo pipefail
cd "$(dirname "$0")/.."

CLANG_FORMAT=.venv/bin/clang-format
if [ ! -x "$CLANG_FORMAT" ]; then
  echo "$CLANG_FORMAT is missing: run bash scripts/setup.sh" >&2
  exit 2
fi
mapfile -t FILES < <(git ls-files 'cc/*' 'ops/*' | grep -E '\.(h|cc|cu|cuh)$')

case "${1:-}" in
  --fix) "$CLANG_FORMAT" -i "${FILES[@]}"; echo "formatted ${#FILES[@]} files"; exit 0 ;;
  "") ;;
  *) echo "usage: bash scripts/format_check.sh [--fix]" >&2; exit 2 ;;
esac
report=$(mktemp)
trap 'rm -f "$report"' EXIT
if ! "$CLANG_FORMAT" --dry-run -Werror "${FILES[@]}" 2> "$report"; then
  grep -o '^[^:]*\.\(h\|cc\|cu\|cuh\):' "$report" | sort -u | sed 's/:$//; s/^/does not conform: /'
  echo "run: bash scripts/format_check.sh --fix" >&2
  exit 1
fi
echo "${#FILES[@]} C++ files conform to .clang-format"
