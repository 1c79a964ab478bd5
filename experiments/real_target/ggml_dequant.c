// Dequantize every tensor of a GGUF file with ggml's own row functions (what llama.cpp runs) and write
// them as raw float32, in file order, to OUT. check_gguf.py compares them with dflash2's loaded weights.
//   cc -O2 -I LLAMA/src/ggml/include ggml_dequant.c LLAMA/build/ggml/src/libggml-base.a -lstdc++ -lgomp -lm -lpthread -o ggml_dequant
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
#include "gguf.h"

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: ggml_dequant FILE.gguf OUT.f32\n"); return 2; }
    struct ggml_context *ctx = NULL;
    struct gguf_init_params params = { /*no_alloc*/ false, &ctx };
    struct gguf_context *g = gguf_init_from_file(argv[1], params);
    if (!g) { fprintf(stderr, "cannot read %s\n", argv[1]); return 1; }
    FILE *out = fopen(argv[2], "wb");
    int64_t n = gguf_get_n_tensors(g);
    for (int64_t i = 0; i < n; i++) {
        struct ggml_tensor *t = ggml_get_tensor(ctx, gguf_get_tensor_name(g, i));
        int64_t count = ggml_nelements(t);
        float *row = malloc(sizeof(float) * count);
        const struct ggml_type_traits *traits = ggml_get_type_traits(t->type);
        if (t->type == GGML_TYPE_F32) {
            for (int64_t j = 0; j < count; j++) row[j] = ((float *) t->data)[j];
        } else if (traits->to_float) {
            traits->to_float(t->data, row, count);
        } else { fprintf(stderr, "no to_float for %s\n", ggml_type_name(t->type)); return 1; }
        fwrite(row, sizeof(float), count, out);
        printf("%s %s %lld\n", ggml_get_name(t), ggml_type_name(t->type), (long long) count);
        free(row);
    }
    fclose(out);
    return 0;
}
