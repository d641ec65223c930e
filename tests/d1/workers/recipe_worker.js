// The recipe's handler as a Worker: recipe.ts (the recipe's code, unmodified)
// behind the two things the recipe leaves to its reader, an auth layer and a
// mutation. The principal is the `X-Principal` header (a test's stand-in for
// the recipe's "your own authentication middleware"); the mutation answers
// 201 with a fresh id, so a replay is told from a second run by its body.
// POST /binary/... is a mutation whose body is not UTF-8 text: it is never
// run by this Worker's own path (the recipe's runMutation returns text), it
// only names the row idemctl completes with such an answer.
import { handleIdempotentMutation } from "./recipe.ts";

let runs = 0;

export default {
  async fetch(request, env, ctx) {
    const url = new URL(request.url);
    if (url.pathname === "/__runs") {
      return new Response(JSON.stringify({ runs }), { headers: { "content-type": "application/json" } });
    }
    const principal = request.headers.get("x-principal");
    if (!principal) {
      return new Response(JSON.stringify({ error: "unauthenticated" }), { status: 401 });
    }
    return handleIdempotentMutation(request, env, ctx, principal, async (bodyBytes) => {
      runs += 1;
      const id = crypto.randomUUID();
      return {
        status: 201,
        body: JSON.stringify({ order: id, bytes: bodyBytes.byteLength }),
        headers: new Headers({ "content-type": "application/json", location: `/orders/${id}` }),
      };
    });
  },
};
