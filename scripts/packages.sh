# Installing Debian/Ubuntu packages, for scripts/setup.sh and scripts/sample.sh
# (sourced, not run).

# Prints the command prefix that can run apt-get ("" as root, "sudo" where
# sudo works without a password), or fails when neither can, when
# WEFT_NO_APT=1, or once apt-get update has failed (an offline machine).
_apt_updated=0
apt_prefix() {
  [ "${WEFT_NO_APT:-0}" != 1 ] && [ "$_apt_updated" != failed ] || return 1
  command -v apt-get >/dev/null || return 1
  if [ "$(id -u)" -eq 0 ]; then
    echo ""
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    echo "sudo"
  else
    return 1
  fi
}

# try_install_packages PKG...: installs them with apt where that is possible;
# returns non-zero (and installs nothing) where it is not.
try_install_packages() {
  local prefix
  prefix=$(apt_prefix) || return 1
  echo "setup: installing $*"
  if [ "$_apt_updated" = 0 ]; then
    # shellcheck disable=SC2086
    $prefix apt-get update -q || { _apt_updated=failed; return 1; }
    _apt_updated=1
  fi
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $prefix apt-get install -y -q --no-install-recommends \
    -o DPkg::Lock::Timeout=600 "$@"
}

# install_packages WHY PKG...: installs them, or names them and exits.
install_packages() {
  local why=$1
  shift
  if ! try_install_packages "$@"; then
    echo "setup: $why is missing; install these packages (Debian/Ubuntu names), then run again:" >&2
    echo "  $*" >&2
    exit 1
  fi
}
