"""Commands that compose the packages below them (the CLI's `inspect`); nothing under `mla_convert` imports from here
but the CLI."""
