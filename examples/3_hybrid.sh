#!/usr/bin/env bash
# Seed pattern 3, hybrid: model parallel inside each replica, data parallel across replicas. The seed wrapped
# a hand-split model in DDP with device_ids that did not match its devices; here 4 ranks form 2 pipeline
# stages x 2 data-parallel replicas (ZeRO-1 over the replicas), all from one plan.
source "$(dirname "$0")/common.sh"
plan_and_train hybrid 4xA100-80GB hybrid --global-batch 8 --pipeline-stages 2
