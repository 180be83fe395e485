# Sourced by the shell scripts in scripts/ (not run on its own): what each needs to read its arguments.
# usage: print the calling script's header comment (its --help).  abspath: a path as the caller's folder sees it,
# for settings read before the script changes to the repository root.
usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
