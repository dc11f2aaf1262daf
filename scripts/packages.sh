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

# make_sample_text: data/fortunes.txt, the sample job's English text (the
# plain-text fortune cookie files Debian ships, installed where missing),
# unless it is there already. Run from the repository's root.
make_sample_text() {
  mkdir -p data
  if [ ! -s data/fortunes.txt ] && [ ! -d /usr/share/games/fortunes ]; then
    install_packages "the sample's text (Debian's fortune files)" fortunes-min fortunes
  fi
  if [ ! -s data/fortunes.txt ]; then
    # The plain-text fortune files: skip the .dat indexes and the .u8 links.
    find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' \
      -print0 | sort -z | xargs -0 cat > data/fortunes.txt
  fi
}
