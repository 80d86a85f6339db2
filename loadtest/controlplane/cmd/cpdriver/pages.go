package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// pagesResult is what list-pages prints.
type pagesResult struct {
	Names []string `json:"names"`
	Pages int      `json:"pages"`
}

// listPages paginates a LIST with limit/continue. Page 1 comes from
// --kubeconfig; with --continue-via the following pages alternate between
// the second kubeconfig (pages 2, 4, ...) and the first (3, 5, ...), so a
// continue token minted by one path is redeemed through the other.
func listPages(args []string) (any, error) {
	fs := newFlagSet("list-pages")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig for page 1 (and odd pages)")
	continueVia := fs.String("continue-via", "", "kubeconfig for even pages (default: --kubeconfig)")
	resource := fs.String("resource", "secrets", "secrets or endpointslices")
	namespace := fs.String("namespace", "", "namespace to list (default: all)")
	limit := fs.Int64("limit", 100, "page size (ListOptions.Limit)")
	accept := fs.String("accept", "", "rest.Config.AcceptContentTypes for both clients")
	timeout := fs.Duration("timeout", 60*time.Second, "overall time limit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if *kubeconfig == "" {
		return nil, errors.New("--kubeconfig is required")
	}
	if *resource != "secrets" && *resource != "endpointslices" {
		return nil, fmt.Errorf("--resource must be secrets or endpointslices, not %q", *resource)
	}
	if *limit <= 0 {
		return nil, errors.New("--limit must be positive")
	}
	first, err := clientFor(*kubeconfig, *accept, "")
	if err != nil {
		return nil, err
	}
	second := first
	if *continueVia != "" {
		if second, err = clientFor(*continueVia, *accept, ""); err != nil {
			return nil, err
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	res := pagesResult{Names: []string{}}
	token := ""
	for {
		client := first
		if res.Pages%2 == 1 { // 0-based: the page about to be fetched is even
			client = second
		}
		opts := metav1.ListOptions{Limit: *limit, Continue: token}
		names, next, err := listPage(ctx, client, *resource, *namespace, opts)
		if err != nil {
			return nil, fmt.Errorf("page %d: %w", res.Pages+1, err)
		}
		res.Pages++
		res.Names = append(res.Names, names...)
		if next == "" {
			return res, nil
		}
		token = next
	}
}

// listPage fetches one page and returns its namespace/name keys in order
// and the continue token.
func listPage(ctx context.Context, client kubernetes.Interface, resource, ns string, opts metav1.ListOptions) ([]string, string, error) {
	var names []string
	switch resource {
	case "secrets":
		l, err := client.CoreV1().Secrets(ns).List(ctx, opts)
		if err != nil {
			return nil, "", err
		}
		for _, o := range l.Items {
			names = append(names, o.Namespace+"/"+o.Name)
		}
		return names, l.Continue, nil
	case "endpointslices":
		l, err := client.DiscoveryV1().EndpointSlices(ns).List(ctx, opts)
		if err != nil {
			return nil, "", err
		}
		for _, o := range l.Items {
			names = append(names, o.Namespace+"/"+o.Name)
		}
		return names, l.Continue, nil
	}
	return nil, "", fmt.Errorf("--resource must be secrets or endpointslices, not %q", resource)
}
