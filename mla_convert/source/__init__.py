"""The source model: its typed config (parsed once), architectures as data, shapes, and a layer-streamed forward."""
