"""The recipes' YAML configs, shipped as this package's data (a folder setuptools would otherwise
warn about as an unlisted package)."""
