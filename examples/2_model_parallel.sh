#!/usr/bin/env bash
# Seed pattern 2, model parallelism: the layers are split over 2 GPUs. The seed moved activations by hand
# between two halves and left one GPU idle at a time; here DeepSpeed's pipeline engine runs the HF model
# converted to a PipelineModule, with micro-batches in a 1F1B schedule so both stages work at once.
source "$(dirname "$0")/common.sh"
plan_and_train model_parallel 2xA100-80GB pipeline --global-batch 8
