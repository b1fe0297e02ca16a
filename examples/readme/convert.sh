# Run: bash examples/readme/convert.sh
# (after trainer.py)
set -e
# To one torch.save file (load_from_checkpoint reads it)
python -m lightning_distckpt convert checkpoints/trainer/last.ckpt checkpoints/model.ckpt
# To a Hugging Face directory (or --to dcp, --to megatron)
python -m lightning_distckpt convert checkpoints/trainer/last.ckpt checkpoints/hf --to safetensors
# Back: a torch.save file becomes a checkpoint
python -m lightning_distckpt convert checkpoints/model.ckpt checkpoints/imported
python -m lightning_distckpt inspect checkpoints/imported  # keys, shapes, shards
