"""The Hugging Face checkpoint format, family-blind: safetensors read through their headers and
written in shards (`safetensors_io`), where each ferry parameter's tensors are (`layout`) and
config.json's keys (`config_json`). The families' mappings (`ferry.models.<family>.hf`) build
on it; `ferry.hf` (loading and saving whole models) builds on both, so the imports run one way:
`ferry.hf` -> `ferry.models` -> `ferry.hf_format`."""
