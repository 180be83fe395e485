"""Checkpoint IO: the streaming reader and writer, safetensors byte streaming, path/hub resolution, asset fetching."""
