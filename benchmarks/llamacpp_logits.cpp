// llama.cpp's logits along a given token sequence, computed as llama-simple computes them (the prompt in one
// batch, then one token a step), for benchmarks/peer_smollm2.py --logits-tool. Not part of TinyLoop; build it
// against a llama.cpp build directory:
//   g++ -O2 -std=c++17 -I$LLAMA/include -I$LLAMA/ggml/include benchmarks/llamacpp_logits.cpp \
//       -L$LLAMA/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA/build/bin -o llamacpp_logits
// usage: llamacpp_logits MODEL.gguf IDS.txt OUT.f32   (IDS.txt: the prompt's length, then every id)
// OUT.f32: float32 rows of n_vocab, one per position from the prompt's last on. Environment: LC_THREADS=n,
// LC_FA=0|1 (flash attention off/on; default auto), LC_KV32=1 (an F32 KV cache; default F16).
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s MODEL.gguf IDS.txt OUT.f32\n", argv[0]); return 2; }
    FILE * f = fopen(argv[2], "r");
    if (!f) return 3;
    int n_prompt = 0, t;
    if (fscanf(f, "%d", &n_prompt) != 1) return 3;
    std::vector<llama_token> ids;
    while (fscanf(f, "%d", &t) == 1) ids.push_back(t);
    fclose(f);
    if (n_prompt < 1 || n_prompt > (int) ids.size()) return 3;
    ggml_backend_load_all();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 4;
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = ids.size() + 1;
    cp.n_batch = n_prompt;
    cp.no_perf = true;
    if (getenv("LC_THREADS")) cp.n_threads = cp.n_threads_batch = atoi(getenv("LC_THREADS"));
    if (getenv("LC_FA")) cp.flash_attn_type = (llama_flash_attn_type) atoi(getenv("LC_FA"));
    if (getenv("LC_KV32")) { cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32; }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return 4;
    FILE * o = fopen(argv[3], "wb");
    if (llama_decode(ctx, llama_batch_get_one(ids.data(), n_prompt))) return 5;
    fwrite(llama_get_logits_ith(ctx, -1), sizeof(float), n_vocab, o);
    for (size_t i = n_prompt; i < ids.size(); i++) {
        if (llama_decode(ctx, llama_batch_get_one(&ids[i], 1))) return 5;
        fwrite(llama_get_logits_ith(ctx, -1), sizeof(float), n_vocab, o);
    }
    fclose(o);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
