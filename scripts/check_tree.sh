#!/usr/bin/env bash
# Tree hygiene, run by CI before the tests: no tracked file over 1 MB, and nothing at the top level
# outside the project's layout (a run directory committed by mistake is caught here).
set -euo pipefail
cd "$(dirname "$0")/.."
LAYOUT=".ci .gitignore README.md bench configs docs examples pyproject.toml scripts src tests"
status=0
while IFS= read -r -d '' path; do
  top=${path%%/*}
  case " $LAYOUT " in
    *" $top "*) ;;
    *) echo "check_tree: '$top' is outside the project's layout ($LAYOUT); remove it or add it to scripts/check_tree.sh" >&2; status=1 ;;
  esac
  if [ -f "$path" ] && [ "$(stat -c %s "$path")" -gt 1048576 ]; then
    echo "check_tree: '$path' is over 1 MB; keep run outputs and binaries out of the tree" >&2; status=1
  fi
done < <(git ls-files -z)
exit $status
