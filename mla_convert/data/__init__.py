"""Text the commands read or make: files, folders and datasets turned into token windows, and text sampled from a model.

Below `convert` (calibration text), `eval` (perplexity windows), `finetune` (training text) and `runtime`
(generation), which all use it."""
