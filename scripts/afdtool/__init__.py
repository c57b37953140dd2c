"""afdtool: the small CLI behind the vLLM-AFD Makefile (stdlib + git only)."""
