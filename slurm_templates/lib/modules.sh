# load_modules NAME...: `module load` for the site files, safe under `set -euo pipefail`.
# Module systems (Lmod, Environment Modules) are not written for `set -u`, and a non-login shell may
# not have the `module` function at all: source the system's init file first.
load_modules() {
  if ! command -v module >/dev/null 2>&1; then
    for init in /usr/share/lmod/lmod/init/bash /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do
      if [ -f "$init" ]; then set +u; source "$init"; set -u; break; fi
    done
  fi
  if ! command -v module >/dev/null 2>&1; then
    echo "MODULES=\"$*\" is set but this shell has no 'module' command" >&2
    return 1
  fi
  set +u
  module load "$@"
  local status=$?
  set -u
  return $status
}
