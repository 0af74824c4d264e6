#!/usr/bin/env bash
# Seed pattern 1, data parallelism: every GPU holds the whole model and a slice of each batch; gradients are
# averaged. The seed hand-wrote DDP with mp.spawn; here the plan picks micro-batch and accumulation so that
# 2 ranks x micro x accum = the global batch exactly, and accelerate launches it.
source "$(dirname "$0")/common.sh"
plan_and_train data_parallel 2xA100-80GB ddp --global-batch 8
