"""ferry's model families; `registry` builds one from a config."""
