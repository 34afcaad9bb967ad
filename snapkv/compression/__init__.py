"""SnapKV and the other methods: the settings (config), window scores, and the hook that cuts each layer's cache."""
